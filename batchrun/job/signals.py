"""SIGTERM / SIGINT / SIGUSR1 during a run: stop admitting rows, drain, commit, exit 5.

The first signal only sets a flag: the runner stops feeding the engine, lets the rows already
in it finish for at most --drain-timeout seconds, commits and exits with EXIT_INTERRUPTED. A
second signal exits at once with the same code: ``os._exit`` from the handler, which is as safe
as a kill -9 because the manifest is the commit record (replaced atomically) and anything past
its committed lengths is cut off on resume.

Handlers are installed only in the main thread (Python delivers signals there; ``signal.signal``
raises elsewhere) and the previous ones are restored afterwards. A CLI process keeps them past
the run (``finish``): a late signal exits with the run's own code. Python's finalization puts
SIG_DFL back for every signal with a Python handler before it tears the modules down (torch's
teardown takes a while), so from the exit handlers on the stop signals are ignored instead.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time

EXIT_INTERRUPTED = 5
STOP_SIGNALS = tuple(
    s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGUSR1", None)) if s is not None
)


class StopSignals:
    """``install()`` / ``restore()`` (or use as a context manager); ``requested`` turns true at
    the first stop signal."""

    def __init__(self, enabled: bool = True, drain_timeout: float = 30.0) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.drain_timeout = drain_timeout
        self.signal_name: str | None = None
        self._since: float | None = None
        self._previous: dict[int, object] = {}
        self._final_code: int | None = None

    @property
    def requested(self) -> bool:
        return self._since is not None

    @property
    def drain_expired(self) -> bool:
        return self._since is not None and time.monotonic() - self._since >= self.drain_timeout

    def request(self, name: str = "stop") -> None:
        """Ask the run to stop as a first signal would (for tests and embedding code)."""
        if self._since is None:
            self.signal_name = name
            self._since = time.monotonic()

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self._final_code is not None:  # the run is over and committed
            os._exit(self._final_code)
        if self.requested:
            _say(
                f"\nbatchrun: {name} again: exiting now; committed rows are kept, run the same "
                "command again to resume\n"
            )
            os._exit(EXIT_INTERRUPTED)
        self.request(name)
        _say(
            f"\nbatchrun: {name}: no new rows; finishing the rows in flight (up to "
            f"{self.drain_timeout:g} s), then committing and exiting with code "
            f"{EXIT_INTERRUPTED} (send it again to exit now)\n"
        )

    def install(self) -> StopSignals:
        """Install the handlers (once; a no-op outside the main thread or when disabled)."""
        if self.enabled and not self._previous:
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def finish(self, exit_code: int) -> None:
        """The run is over (committed): from now on a stop signal exits the process at once
        with `exit_code` instead of the default action (for a CLI process about to exit), and
        from the interpreter's exit handlers on it is ignored (the process exits with its code
        anyway)."""
        if self._previous and self._final_code is None:
            atexit.register(_ignore_stop_signals)
        self._final_code = exit_code

    def restore(self) -> None:
        """Put the previous handlers back."""
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> StopSignals:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()


def _ignore_stop_signals() -> None:
    """At exit, after the run committed: a stop signal changes nothing any more (the process
    exits with the run's code), and the default action would kill it by the signal."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def _say(message: str) -> None:
    try:  # os.write: safe in a signal handler, unlike a buffered stream
        os.write(2, message.encode())
    except OSError:
        pass
