"""Timing a CUDA call over inputs cycled past the L2 (bench-only)."""

from __future__ import annotations

import statistics

import torch


def cycled_time_us(fn, inputs: list, iters: int, runs: int = 5) -> float:
    """Median over `runs` of the µs per call of fn(inputs[i % len(inputs)]) in a loop of
    `iters` calls (CUDA events; a plain loop, no graph: the host's launch cost counts where
    it exceeds the device's), after one warm-up call per input."""
    for x in inputs:
        fn(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            fn(inputs[i % len(inputs)])
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / iters)
    return statistics.median(times)
