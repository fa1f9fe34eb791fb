"""Where the GPU waits in a run: each step's forward on the device (its CUDA events) and the gap
before it, by the kind of step (a decode graph, a piecewise-graph or eager forward), with the
host's time between launches. Bench-only instrumentation: it wraps the runner's internal
`_run_forward` (batchrun/engine/model_runner.py), for measurement only.

The gap before a forward holds the step before's sampling and copies and this step's input
kernels as well as any idle time; the smallest gaps of a kind are that work alone, so the
report gives each kind's idle as the sum of (gap - the kind's 10th-percentile gap).

    trace = StepTrace(engine)
    ... run ...
    trace.close()
    print(trace.report())
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import defaultdict


def step_kind(runner, staged) -> str:
    """How runner._run_forward will run this staged step (mirrors ModelRunner._forward)."""
    attn = staged.attn
    graphs = runner.graphs
    if graphs is not None and graphs.can_run(attn):
        return "decode-graph"
    piecewise = runner.piecewise
    if piecewise is not None and piecewise.can_run(staged.input_ids.shape[0]):
        return "piecewise"
    return "eager"


def size_bucket(n: int) -> str:
    """A power-of-two bucket label for a batch size or a token count."""
    top = 1
    while top < n:
        top *= 2
    return f"<={top}"


def deciles(values: list[float]) -> tuple[float, float, float]:
    """(p10, p50, p90) of values, each the element at that rank (no interpolation)."""
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 10], ordered[n // 2], ordered[9 * n // 10]


class StepTrace:
    def __init__(self, engine):
        self.runner = engine.runner
        # (kind, tokens, requests, host time of the launch, start event, end event)
        self.steps: list[tuple[str, int, int, float, object, object]] = []
        # host times of the timed run's start and end (set by the caller): how long the host
        # took to the first launch, and from the last launch to the end
        self.run_start: float | None = None
        self.run_end: float | None = None
        # Python's garbage collections (generation, start, end), and the host time of the first
        # engine.step() call: where the time before the first launch goes
        self.collections: list[tuple[int, float, float]] = []
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)
        self.engine = engine
        self.first_step: float | None = None
        # what the instances themselves held under the wrapped names (None: the class's
        # method), put back by close()
        self._saved = (vars(engine).get("step"), vars(self.runner).get("_run_forward"))
        inner_step = engine.step

        def step():
            if self.first_step is None and self.run_start is not None:
                self.first_step = time.perf_counter()
            return inner_step()

        engine.step = step
        runner = self.runner
        # NOTE: the runner's internals (ModelRunner.launch calls self._run_forward), wrapped for
        # measurement only
        inner = runner._run_forward

        def traced(staged):
            kind = step_kind(runner, staged)
            t = time.perf_counter()
            fwd = inner(staged)
            if fwd.forward_start is not None:
                tokens = staged.input_ids.shape[0]
                self.steps.append(
                    (kind, tokens, len(staged.attn.seq_lens_cpu), t, fwd.forward_start,
                     fwd.forward_end)
                )  # fmt: skip
            return fwd

        runner._run_forward = traced

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.collections.append((info["generation"], self._gc_start, time.perf_counter()))

    def close(self) -> None:
        for owner, name, saved in zip(
            (self.engine, self.runner), ("step", "_run_forward"), self._saved
        ):
            if saved is not None:
                setattr(owner, name, saved)
            elif name in vars(owner):
                delattr(owner, name)
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self.steps:
            import torch

            torch.cuda.synchronize(self.runner.device)

    def rows(self) -> list[dict]:
        """One dict per step: kind, tokens, requests, fwd_ms, gap_ms (None for the first), and
        host_ms (host time since the previous launch)."""
        out = []
        prev_t = prev_end = None
        for kind, tokens, reqs, t, start, end in self.steps:
            row = {"kind": kind, "tokens": tokens, "requests": reqs}
            row["fwd_ms"] = start.elapsed_time(end)
            row["gap_ms"] = prev_end.elapsed_time(start) if prev_end is not None else None
            row["host_ms"] = 1e3 * (t - prev_t) if prev_t is not None else None
            out.append(row)
            prev_t, prev_end = t, end
        return out

    def _gc_report(self, first_launch: float) -> str:
        """Python's collections inside the run, by generation: count and ms, and those before
        the first launch."""
        inside = [c for c in self.collections if self.run_start <= c[1] <= self.run_end]
        parts = []
        for gen in (0, 1, 2):
            ours = [(start, end) for g, start, end in inside if g == gen]
            took = [end - start for start, end in ours]
            before = sum(end - start for start, end in ours if end <= first_launch)
            if took:
                parts.append(
                    f"gen{gen} {len(took)} x, {1e3 * sum(took):.1f} ms (max {1e3 * max(took):.1f}; "
                    f"{1e3 * before:.1f} before the first launch)"
                )
        return "gc in the run: " + ("; ".join(parts) or "none")

    def report(self) -> str:
        rows = self.rows()
        if not rows:
            return "step trace: no CUDA steps"
        groups: dict[str, list[dict]] = defaultdict(list)
        for r in rows[1:]:
            kind = r["kind"]
            label = f"{kind} {size_bucket(r['requests'])}" if kind == "decode-graph" else kind
            groups[label].append(r)
        span = rows[0]["fwd_ms"] + sum(r["gap_ms"] + r["fwd_ms"] for r in rows[1:])
        lines = [
            f"step trace: {len(rows)} steps over {span:.1f} ms of device time (first start to "
            f"last end); forwards {sum(r['fwd_ms'] for r in rows):.1f} ms",
            "kind | steps | fwd ms (mean / p50 / p90) | gap before: sum / p10 / p50 / p90 ms "
            "| idle est. ms | host ms between launches (p50)",
        ]
        total_idle = 0.0
        for label in sorted(groups, key=lambda k: -sum(r["fwd_ms"] for r in groups[k])):
            g = groups[label]
            fwd = [r["fwd_ms"] for r in g]
            gaps = [r["gap_ms"] for r in g]
            _, fwd50, fwd90 = deciles(fwd)
            gap10, gap50, gap90 = deciles(gaps)
            idle = sum(x - gap10 for x in gaps)
            total_idle += idle
            host = statistics.median(r["host_ms"] for r in g)
            lines.append(
                f"{label} | {len(g)} | {sum(fwd):.1f} ({statistics.mean(fwd):.3f} / "
                f"{fwd50:.3f} / {fwd90:.3f}) | {sum(gaps):.1f} / {gap10:.3f} / {gap50:.3f} / "
                f"{gap90:.3f} | {idle:.1f} | {host:.3f}"
            )
        lines.append(f"idle (est.) {total_idle:.1f} ms = {total_idle / span:.3f} of the span")
        if self.run_start is not None and self.run_end is not None:
            first, last = self.steps[0][3], self.steps[-1][3]
            lines.append(
                f"host: first launch {1e3 * (first - self.run_start):.1f} ms after the run's "
                f"start, the run's end {1e3 * (self.run_end - last):.1f} ms after the last launch"
            )
            if self.first_step is not None:
                lines.append(
                    f"host: first engine.step() {1e3 * (self.first_step - self.run_start):.1f} ms "
                    "after the run's start (requests fed before it)"
                )
            lines.append(self._gc_report(first))
        # the longest gaps, with the steps on either side: where the host fell behind
        worst = sorted(range(1, len(rows)), key=lambda i: -rows[i]["gap_ms"])[:8]
        for i in sorted(worst):
            a, b = rows[i - 1], rows[i]
            lines.append(
                f"  gap {b['gap_ms']:.2f} ms before step {i} ({b['kind']}, {b['tokens']} tokens, "
                f"{b['requests']} reqs) after ({a['kind']}, {a['tokens']} tokens)"
            )
        return "\n".join(lines)
