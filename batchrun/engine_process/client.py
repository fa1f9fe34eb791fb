"""`EngineProcess`: the engine in its own process, behind the surface the job runner drives.

    add_request(request)   buffered; sent with the others at the next step() as one Submit
    step() -> results      sends what is buffered, then waits (up to `poll_interval` s) for the
                           next Results message and returns every completion that has arrived
    wants_requests         room in the in-flight window (completions sent and not yet back)
    drop_waiting()         a graceful stop: the engine forgets what has not started
    has_work               completions still to come back
    counters               the engine's EngineCounters, as of the latest message
    close()                Shutdown, then join (terminate if it does not go)

The main process keeps reading, tokenizing, writing and serving progress while the engine runs.
A reader thread takes frames off the connection as they arrive, so the engine never blocks on a
full pipe while the main process is busy (and neither side can deadlock on two full pipes); it
wakes the main thread once per message, and the engine sends one message per `notify_batch`
finished completions (notify.py). The in-flight window (default: the engine's max_pending +
max_running completions) is the backpressure: a fast reader cannot queue the whole dataset.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import queue
import threading
import weakref
from collections.abc import Callable

import batchrun.engine_process.messages as m
from batchrun.config import MAX_RUNNING, EngineConfig, KernelPlan, resolve_sizes
from batchrun.engine_process.notify import DEFAULT_MAX_DELAY, DEFAULT_NOTIFY_BATCH
from batchrun.engine_process.worker import worker_main
from batchrun.errors import ModelError, RunError
from batchrun.models.config import ModelConfig, ModelConfigError
from batchrun.models.embedded import resolve_model_path
from batchrun.models.hub import load_tokenizer
from batchrun.params import GenerateRequest, GenerateResult, check_input_ids

_EOF = object()  # the reader thread's last item: the connection closed
# NOTE: at exit, multiprocessing joins every non-daemonic child; an engine process that nobody
# closed waits for messages forever, so the interpreter would never exit. This hook (registered
# after multiprocessing's, so it runs first) closes whatever is still open.
_open_clients: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_clients() -> None:
    for client in list(_open_clients):
        client.close(timeout=5)


class EngineProcessError(RunError):
    """The engine process failed or died; what was committed stays committed."""


class EngineProcess:
    def __init__(
        self,
        config: EngineConfig,
        *,
        notify_batch: int = DEFAULT_NOTIFY_BATCH,
        max_delay: float = DEFAULT_MAX_DELAY,
        window: int | None = None,
        device_index: int | None = None,
        poll_interval: float = 0.25,
        name: str = "batchrun-engine",
        engine_factory: Callable | None = None,
        load_tokenizer: bool = True,
        wakeup: threading.Event | None = None,
        wait: bool = True,
    ):
        """Starts the engine process. With wait=False the caller calls finish_start() later
        (data parallel starts every engine first, then waits for all). `wakeup` is set whenever
        a message arrives (one event can watch several engine processes)."""
        config.validate()
        # NOTE: resolved here, before the engine process starts: the embedded model's one-time
        # GGUF conversion then happens once, and the tokenizer below loads from the same place.
        # A custom engine_factory (tests) brings no model: no tokenizer either.
        self.model_dir = resolve_model_path(config.model) if engine_factory is None else None
        if self.model_dir is not None:  # the engine's own default, known before it starts
            try:
                config = resolve_sizes(config, ModelConfig.from_dir(self.model_dir))
            except (ModelConfigError, OSError, ValueError):
                pass  # the engine process reports a model it cannot load (ModelError)
        self.config = config
        self.window = window or config.max_pending + (config.max_running or MAX_RUNNING)
        self.poll_interval = poll_interval
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=worker_main,
            args=(config, child, device_index, notify_batch, max_delay, engine_factory),
            name=name,
            daemon=False,  # an engine process may start tensor-parallel ranks of its own
        )
        self._proc.start()
        _open_clients.add(self)
        child.close()  # ours is the only parent end left: EOF when the engine process dies
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = wakeup
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._reader.start()
        self._buffer: list[GenerateRequest] = []
        self._inflight = 0  # completions sent (or buffered) and not yet back
        self._drop_sent = False
        self._closed = False
        self.counters = m.EngineCounters()  # replaced by each Results message's
        self._load_tokenizer_here = load_tokenizer and self.model_dir is not None
        self._tokenizer = None
        if wait:
            self.finish_start()

    # -- start-up ----------------------------------------------------------------------------

    def finish_start(self) -> None:
        """Load the tokenizer (while the engine process loads the model), then wait for it."""
        try:
            # the engine process's verdict on the model comes first
            tokenizer_error = None
            try:
                if self._load_tokenizer_here:
                    self._tokenizer = self._load_tokenizer()
            except (ValueError, OSError) as e:
                tokenizer_error = e
            ready = self._wait_ready()
            if tokenizer_error is not None:
                raise ModelError(
                    f"cannot load the tokenizer from {self.model_dir}: {tokenizer_error}"
                ) from tokenizer_error
        except BaseException:
            self.close()
            raise
        self.context_len = ready.context_len
        self.num_kv_slots = ready.num_kv_slots
        self.vocab_size = ready.vocab_size
        self.device = ready.device
        self.kernels = KernelPlan(**ready.kernels)  # as the engine process resolved them

    def _load_tokenizer(self):
        return load_tokenizer(self.model_dir)

    @property
    def tokenizer(self):
        return self._tokenizer

    def _wait_ready(self) -> m.Ready:
        while True:
            msg = self._next(timeout=1.0)
            if msg is None:
                continue  # still loading (_next raises if the process died)
            if isinstance(msg, m.Ready):
                return msg
            if isinstance(msg, m.Failed):
                if msg.kind == "model":
                    raise ModelError(f"cannot load the model: {msg.message}")
                raise EngineProcessError(f"the engine process failed to start: {msg.message}")
            raise EngineProcessError(f"unexpected message from the engine process: {msg!r}")

    # -- the engine surface ------------------------------------------------------------------

    def add_request(self, request: GenerateRequest) -> None:
        """Buffer a request (sent at the next step). Its input_ids are checked here, with the
        engine's message: ids that are not ints would fail the whole Submit message there."""
        check_input_ids(request.rid, request.input_ids, self.vocab_size)
        self._buffer.append(request)
        self._inflight += request.params.n
        self._drop_sent = False

    @property
    def wants_requests(self) -> bool:
        return self._inflight < self.window

    @property
    def has_work(self) -> bool:
        return self._inflight > 0

    def drop_waiting(self) -> int:
        """Forget buffered requests; ask the engine to forget the ones it has not started.
        Returns how many buffered completions were dropped here (the engine's count arrives
        later, as a `Dropped` message that step() accounts for)."""
        dropped = sum(r.params.n for r in self._buffer)
        self._buffer.clear()
        self._inflight -= dropped
        if not self._drop_sent:
            self._send(m.DropWaiting())
            self._drop_sent = True
        return dropped

    def step(self) -> list[GenerateResult]:
        self.flush()
        return self.collect(self.poll_interval)

    def flush(self) -> None:
        """Send the buffered requests as one message."""
        if self._buffer:
            self._send(m.Submit(self._buffer))
            self._buffer = []

    def collect(self, timeout: float) -> list[GenerateResult]:
        """Every completion that has arrived, waiting up to `timeout` s for the first message."""
        results: list[GenerateResult] = []
        msg = self._next(timeout)
        while msg is not None:
            self._handle(msg, results)
            msg = self._next(timeout=0)
        return results

    @property
    def load(self) -> int:
        """Completions in flight (data parallel routes to the least loaded engine)."""
        return self._inflight

    def _handle(self, msg, results: list[GenerateResult]) -> None:
        if isinstance(msg, m.Results):
            results.extend(msg.results)
            self._inflight -= len(msg.results)
            if msg.counters is not None:
                self.counters = msg.counters
        elif isinstance(msg, m.Dropped):
            self._inflight -= msg.num_samples
        elif isinstance(msg, m.Failed):
            raise EngineProcessError(
                f"the engine process failed: {msg.message}\n{msg.traceback}".rstrip()
                + "\nrows committed so far are intact; run the same command again to resume"
            )
        else:
            raise EngineProcessError(f"unexpected message from the engine process: {msg!r}")

    # -- transport ---------------------------------------------------------------------------

    def _read(self) -> None:
        conn, inbox = self._conn, self._inbox
        try:
            while True:
                inbox.put(m.decode_from_engine(conn.recv_bytes()))
                if self._wakeup is not None:
                    self._wakeup.set()
        except (EOFError, OSError):
            inbox.put(_EOF)
            if self._wakeup is not None:
                self._wakeup.set()

    def _next(self, timeout: float):
        """The next message, None if none came within `timeout`; raises if the process died."""
        try:
            msg = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None
        if msg is _EOF:
            self._inbox.put(_EOF)  # every later call sees it too
            raise EngineProcessError(self._death_message())
        return msg

    def _death_message(self) -> str:
        self._proc.join(timeout=5)
        code = self._proc.exitcode
        how = (
            f"was killed by signal {-code}" if code is not None and code < 0
            else f"exited with code {code}" if code is not None
            else "closed its connection"
        )  # fmt: skip
        return (
            f"the engine process (pid {self._proc.pid}) {how} while rows were in flight; "
            "rows committed so far are intact: run the same command again to resume"
        )

    def _send(self, msg) -> None:
        try:
            self._conn.send_bytes(m.encode(msg))
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            raise EngineProcessError(self._death_message()) from e

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def close(self, timeout: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        if self._proc.is_alive():
            try:
                self._conn.send_bytes(m.encode(m.Shutdown()))
            except OSError:
                pass
            self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()
        self._reader.join(timeout=1)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # a forgotten client must not leave a process behind
        try:
            if not self._closed and self._proc.is_alive():
                self._proc.kill()
        except Exception:
            pass
