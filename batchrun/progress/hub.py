"""What a running `submit` publishes for `--serve-progress`, with no server dependency: the
thread-safe ProgressHub the runner writes to and the HubState the server drains from it. The
runner only ever takes the hub's one short lock; the server (server.py) drains the hub on its
own thread every 0.5 s and sums it up in a Snapshot (snapshot.py). Policy: see server.py.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import NamedTuple

from batchrun.params import EngineCounters

MAX_ERRORS = 20  # the last error records the hub keeps for the page
MAX_ERROR_MESSAGE = 300  # characters of an error message kept


class RowCounts(NamedTuple):
    """A RunSummary's counts (the whole run, earlier attempts included, but session_tokens)."""

    rows: int = 0
    rows_ok: int = 0
    rows_failed: int = 0
    resumed_rows: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    session_tokens: int = 0  # output tokens of the rows this attempt finished


class ErrorInfo(NamedTuple):
    row: int
    id: str
    type: str
    message: str


class HubState(NamedTuple):
    """Everything the hub holds, as one drain() sees it."""

    counts: RowCounts
    total: int | None
    elapsed: float
    status: str
    rows: list[bytes]  # encoded records since the last drain (only while wanted)
    rows_lost: bool  # rows were dropped since the last drain (max_rows overflowed)
    engine: EngineCounters  # the engines' counters, summed
    engines: tuple[EngineCounters, ...]  # per engine, with --dp; else empty
    errors: tuple[ErrorInfo, ...]  # the last MAX_ERRORS error records, oldest first
    shard: tuple[int, int] | None  # (index, count) of a sharded run


class ProgressHub:
    """Thread-safe meeting point: the runner publishes, the server's tick drains. Never blocks
    beyond one short lock; rows are kept only while a rows client wants them."""

    def __init__(self, max_rows: int = 65_536):
        self._lock = threading.Lock()
        self._counts = RowCounts()
        self._total: int | None = None
        self._shard: tuple[int, int] | None = None
        self._start = time.perf_counter()
        self._rows: list[bytes] = []
        self._rows_lost = False
        self._engine = EngineCounters()
        self._engines: tuple[EngineCounters, ...] = ()
        self._errors: deque[ErrorInfo] = deque(maxlen=MAX_ERRORS)
        self._status = "starting"
        self._end: float | None = None  # perf_counter at finish(): elapsed stops there
        self.max_rows = max_rows
        self.want_rows = False  # set by the server while a ?rows=1 client is connected

    def start(self, total: int | None, summary, shard: tuple[int, int] | None = None) -> None:
        """The attempt starts (elapsed counts from here); `shard`: (index, count) of a sharded
        run."""
        with self._lock:
            self._total, self._start, self._status = total, time.perf_counter(), "running"
            self._shard = shard
        self.update(summary)

    def update(self, s) -> None:
        """Counts of a RunSummary (copied: the runner goes on mutating it)."""
        counts = RowCounts(
            s.rows,
            s.rows_ok,
            s.rows_failed,
            s.resumed_rows,
            s.prompt_tokens,
            s.cached_tokens,
            s.completion_tokens,
            s.session_tokens,
        )
        with self._lock:
            self._counts = counts

    def update_engine(
        self, counters: EngineCounters, per_engine: tuple[EngineCounters, ...] = ()
    ) -> None:
        """The engines' latest counters (immutable structs: kept as given)."""
        with self._lock:
            self._engine, self._engines = counters, per_engine

    def add_error(self, row: int, id: str, type: str, message: str) -> None:
        """A row that went to the errors file (the last MAX_ERRORS are kept)."""
        info = ErrorInfo(row, id, type, message[:MAX_ERROR_MESSAGE])
        with self._lock:
            self._errors.append(info)

    def add_rows(self, lines: list[bytes]) -> None:
        if not self.want_rows:
            return
        with self._lock:
            if len(self._rows) + len(lines) > self.max_rows:
                self._rows.clear()
                self._rows_lost = True
            else:
                self._rows.extend(lines)

    def finish(self, status: str) -> None:
        with self._lock:
            self._status = status
            self._end = time.perf_counter()

    def drain(self) -> HubState:
        with self._lock:
            rows, self._rows = self._rows, []
            lost, self._rows_lost = self._rows_lost, False
            return HubState(
                counts=self._counts,
                total=self._total,
                elapsed=(self._end or time.perf_counter()) - self._start,
                status=self._status,
                rows=rows,
                rows_lost=lost,
                engine=self._engine,
                engines=self._engines,
                errors=tuple(self._errors),
                shard=self._shard,
            )

    @property
    def is_finished(self) -> bool:
        return self._status not in ("starting", "running")
