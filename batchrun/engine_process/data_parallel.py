"""Data parallel: one engine process per GPU (or per tensor-parallel group), one feeder.

The runner drives it like one engine. Requests arrive in prefix (DFS) order; each goes to

    the engine that got the previous request, when the two share at least STICKY_PREFIX
    tokens and that engine is not more than `slack` completions ahead of the least loaded one
    (a prefix group stays on one GPU, where the radix cache computes the prefix once);
    otherwise the least loaded engine (completions in flight).

Routing by load, not by a fixed split, is what keeps the tail short: an engine that finishes its
share early gets the next requests, so no GPU idles while another still works through a long
queue; and the slack bound keeps one huge prefix group (every row with the same system prompt)
from landing on a single GPU: it spills over, and each GPU computes the prefix once.

Results come back from every engine process through their reader threads; one Event wakes the
main thread when any of them has a message.
"""

from __future__ import annotations

import threading
import time

import torch

from batchrun.config import MAX_RUNNING, EngineConfig
from batchrun.engine_process.client import EngineProcess
from batchrun.engine_process.notify import DEFAULT_NOTIFY_BATCH
from batchrun.params import EngineCounters, GenerateRequest, GenerateResult

STICKY_PREFIX = 32  # tokens a request must share with the previous one to follow it


class DataParallelEngine:
    def __init__(
        self,
        config: EngineConfig,
        dp: int,
        *,
        notify_batch: int = DEFAULT_NOTIFY_BATCH,
        device_indices: list[int | None] | None = None,
        poll_interval: float = 0.25,
        load_tokenizer: bool = True,
    ):
        if dp < 1:
            raise ValueError(f"dp must be >= 1; got {dp}")
        indices = device_indices or [None] * dp
        if len(indices) != dp:
            raise ValueError(f"{dp} engines need {dp} device indices; got {indices}")
        self.poll_interval = poll_interval
        self._wakeup = threading.Event()
        self.engines: list[EngineProcess] = []
        try:
            for i, device_index in enumerate(indices):
                self.engines.append(
                    EngineProcess(
                        config,
                        notify_batch=notify_batch,
                        device_index=device_index,
                        name=f"batchrun-engine-{i}",
                        load_tokenizer=load_tokenizer and i == 0,
                        wakeup=self._wakeup,
                        wait=False,
                    )
                )
            for engine in self.engines:  # every engine loads its model at the same time
                engine.finish_start()
        except BaseException:
            self.close()
            raise
        first = self.engines[0]
        self.tokenizer = first.tokenizer
        self.context_len = first.context_len
        self.vocab_size = first.vocab_size
        self.num_kv_slots = first.num_kv_slots
        self.kernels = first.kernels  # every engine resolves the same on the same GPUs
        self.window = first.window
        # how far the sticky engine may run ahead of the least loaded one
        self.slack = max(1, (first.config.max_running or MAX_RUNNING) // 2)
        self._last: list[int] | None = None  # the previous request's tokens
        self._last_engine = 0
        self.routed = [0] * dp  # requests per engine (reported, tested)

    # -- the engine surface ------------------------------------------------------------------

    def add_request(self, request: GenerateRequest) -> None:
        engine = self._route(request.input_ids)
        self.engines[engine].add_request(request)
        self.routed[engine] += 1
        self._last, self._last_engine = request.input_ids, engine

    def _route(self, input_ids: list[int]) -> int:
        loads = [e.load for e in self.engines]
        least = min(range(len(loads)), key=loads.__getitem__)
        last = self._last
        if last is not None and loads[self._last_engine] - loads[least] <= self.slack:
            n = min(STICKY_PREFIX, len(last), len(input_ids))
            if n == STICKY_PREFIX and last[:n] == input_ids[:n]:
                return self._last_engine
        return least

    @property
    def wants_requests(self) -> bool:
        return min(e.load for e in self.engines) < self.window

    @property
    def has_work(self) -> bool:
        return any(e.has_work for e in self.engines)

    def drop_waiting(self) -> int:
        return sum(e.drop_waiting() for e in self.engines)

    @property
    def counters(self) -> EngineCounters:
        """The engines' counters summed (KV slots too: used and total over all pools)."""
        return sum(self.counters_per_engine, EngineCounters())

    @property
    def counters_per_engine(self) -> list[EngineCounters]:
        return [e.counters for e in self.engines]

    def step(self) -> list[GenerateResult]:
        for engine in self.engines:
            engine.flush()
        deadline = time.monotonic() + self.poll_interval
        while True:
            self._wakeup.clear()  # before looking: a message that lands after is not missed
            results: list[GenerateResult] = []
            for engine in self.engines:
                results += engine.collect(timeout=0)
            left = deadline - time.monotonic()
            if results or left <= 0:
                return results
            self._wakeup.wait(left)

    def close(self) -> None:
        for engine in self.engines:
            engine.close()

    def __enter__(self) -> DataParallelEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def device_indices(config: EngineConfig, dp: int) -> list[int | None]:
    """The first GPU of each engine process (each uses tp_size GPUs from there); None on CPU."""
    tp = getattr(config, "tp_size", 1)
    if config.device == "cpu":
        return [None] * dp
    if not torch.cuda.is_available():
        return [None] * dp  # device auto on a machine without CUDA: CPU engines
    have, need = torch.cuda.device_count(), dp * tp
    if need > have:
        raise ValueError(
            f"--dp {dp} x --tp {tp} needs {need} GPUs; this machine has {have}: lower --dp or --tp"
        )
    return [i * tp for i in range(dp)]
