"""When the engine process tells the main process about finished completions.

Waking the main process has a price on both sides (a frame to encode and send, a thread to wake,
a message to decode and dispatch), and it is paid per wake-up, not per completion. So finished
completions are held until `notify_batch` of them are ready and then sent as one message. Holding
them never loses or starves any: they go out at once when the engine has nothing left to run (the
final flush), when the main process asks for a stop, and at the latest `max_delay` seconds after
the oldest one finished (so a slow model still reports progress and commits on time).

The engine's counters (tokens generated so far, running and waiting requests, KV use) ride on
these messages. While steps run and nothing finishes (the first minutes of a slow model, or long
completions), a message with the counters alone goes out at most every `max_delay` seconds, so
the job's token rate moves as tokens are generated; one more goes out when the engine goes idle.
Never one message per token, nor per step once steps are faster than `max_delay`.

At most one message per engine step: the check runs once after each step.
"""

from __future__ import annotations

import time

from batchrun.params import GenerateResult

DEFAULT_NOTIFY_BATCH = 16
DEFAULT_MAX_DELAY = 0.5  # seconds


class NotifyBatcher:
    def __init__(
        self, notify_batch: int = DEFAULT_NOTIFY_BATCH, max_delay: float = DEFAULT_MAX_DELAY
    ):
        if notify_batch < 1:
            raise ValueError(f"notify_batch must be >= 1; got {notify_batch}")
        self.notify_batch = notify_batch
        self.max_delay = max_delay
        self._held: list[GenerateResult] = []
        self._oldest = 0.0  # monotonic time the oldest held completion finished
        self._stepped = False  # a step ran since the last message: the counters moved
        self._last_sent = time.monotonic()

    def add(self, results: list[GenerateResult]) -> None:
        if results and not self._held:
            self._oldest = time.monotonic()
        self._held.extend(results)

    def stepped(self) -> None:
        """The engine ran a step (its counters changed)."""
        self._stepped = True

    def due(self, idle: bool) -> bool:
        """Send now? `idle`: the engine has nothing left to run (flush everything)."""
        held = len(self._held)
        if held >= self.notify_batch:
            return True
        if not held and not self._stepped:
            return False
        now = time.monotonic()
        if held and now - self._oldest >= self.max_delay:
            return True
        # the counters alone (held is 0, or younger than max_delay)
        return idle or now - self._last_sent >= self.max_delay

    def take(self) -> list[GenerateResult]:
        """The held completions, for the message about to go out (with the counters)."""
        held, self._held = self._held, []
        self._stepped = False
        self._last_sent = time.monotonic()
        return held

    def __len__(self) -> int:
        return len(self._held)
