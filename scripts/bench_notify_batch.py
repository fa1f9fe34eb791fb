"""Wake-ups and CPU time per finished row with --notify-batch 1 vs 16.

The real transport end to end: a spawned engine process running batchrun's worker loop
(batchrun/engine_process/worker.py with its NotifyBatcher) and the real EngineProcess client in
this process. Only the model is replaced: a stand-in engine finishes rows at a decode-like rhythm
(0-3 per step, 1 on average) and does no device work, so every microsecond measured is the
notification path: encoding, the pipe, the reader thread, decoding and dispatch.

    python scripts/bench_notify_batch.py [--rows 100000] [--batches 1,16]

Reports per setting: messages (= wake-ups of the main process), CPU time per row in the main
process and in the engine process, and wall time.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

from batchrun.config import EngineConfig, KernelConfig
from batchrun.engine_process.client import EngineProcess
from batchrun.params import EngineCounters, GenerateRequest, GenerateResult, SamplingParams

FINISH_PATTERN = (1, 0, 2, 1, 0, 3, 1, 0)  # rows finished per step: 1 on average


class StandInEngine:
    """The Engine surface the worker loop uses, finishing rows without a model."""

    def __init__(self, config, device_index):
        self.context_len = 4096
        self.num_kv_slots = 1 << 20
        self.device = "cpu"
        self.kernels = KernelConfig.reference()  # what a CPU engine resolves to
        self.model_config = SimpleNamespace(vocab_size=32000)
        self.stats = SimpleNamespace(num_steps=0, num_forward_tokens=0, forward_time=0.0)
        self._queue: list[GenerateRequest] = []
        self._step = 0
        self._cpu0: float | None = None

    @property
    def counters(self) -> EngineCounters:
        stats = self.stats
        return EngineCounters(stats.num_steps, stats.num_forward_tokens, stats.forward_time)

    def add_request(self, request: GenerateRequest) -> None:
        self._queue.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self._queue)

    def drop_waiting(self) -> int:
        return 0

    def step(self) -> list[GenerateResult]:
        # the engine process's CPU time since its first step (start-up imports excluded),
        # reported through the counters every Results message carries
        if self._cpu0 is None:
            self._cpu0 = time.process_time()
        self.stats.forward_time = time.process_time() - self._cpu0
        k = FINISH_PATTERN[self._step % len(FINISH_PATTERN)]
        self._step += 1
        self.stats.num_steps += 1
        done, self._queue = self._queue[:k], self._queue[k:]
        return [
            GenerateResult(r.rid, list(range(64)), "length", len(r.input_ids), 64, 0) for r in done
        ]


def make_engine(config, device_index):
    return StandInEngine(config, device_index)


def run(rows: int, notify_batch: int) -> dict:
    config = EngineConfig(device="cpu", max_pending=4096, max_running=256)
    params = SamplingParams(max_new_tokens=64)
    prompt = list(range(100))
    ep = EngineProcess(config, notify_batch=notify_batch, engine_factory=make_engine)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    messages = 0
    real_handle = ep._handle

    def counting_handle(msg, results):  # one call per message = one wake-up
        nonlocal messages
        messages += 1
        real_handle(msg, results)

    ep._handle = counting_handle
    sent = received = 0
    while received < rows:
        while sent < rows and ep.wants_requests:
            ep.add_request(GenerateRequest(str(sent), prompt, params))
            sent += 1
        received += len(ep.step())
    cpu_main, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    engine_cpu = ep.counters.forward_time  # see StandInEngine.step
    ep.close()
    return {
        "notify_batch": notify_batch,
        "messages": messages,
        "rows_per_message": rows / messages,
        "main_us_per_row": cpu_main / rows * 1e6,
        "engine_us_per_row": engine_cpu / rows * 1e6,
        "wall_s": wall,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--batches", default="1,16")
    args = ap.parse_args(argv)
    print(f"{args.rows:,} finished rows through a real engine process (stand-in model)\n")
    print(
        "| --notify-batch | wake-ups | rows / wake-up | main CPU µs / row | "
        "engine CPU µs / row | wall s |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for b in (int(x) for x in args.batches.split(",")):
        r = run(args.rows, b)
        print(
            f"| {b} | {r['messages']:,} | {r['rows_per_message']:.1f} | "
            f"{r['main_us_per_row']:.1f} | {r['engine_us_per_row']:.1f} | {r['wall_s']:.2f} |"
        )


if __name__ == "__main__":
    main()
