"""Where a decode step's GPU time goes: the engine's steady decode under torch.profiler, kernel
time per step by kernel, the number of launches, and the GPU's busy fraction of the wall time.

    python scripts/profile_decode.py --model llama-8b --batch 1            # W3's step
    python scripts/profile_decode.py --model llama-1b --batch 256          # W1's decode step
    python scripts/profile_decode.py --device cpu --model tiny --batch 4   # CPU smoke test
    python scripts/profile_decode.py --model llama-8b --workload W1 --scale 0.25   # a whole run
    python scripts/profile_decode.py --model llama-8b --batch 1 --chain   # each kernel's cost
    python scripts/profile_decode.py --model llama-1b --batch 1 --kernel pdl=false   # a variant
    python scripts/profile_decode.py --model llama-8b --checkpoint-format awq   # INT4's W3 step

With --chain, each kernel of the steady step is also given what its end adds after the ends
before it: its cost in the chain, where PDL kernels start early and wait (their durations count
the wait).

With --workload, a whole run of a bench_throughput workload (prefills, mixed and decode steps,
the engine's default sizes) is profiled instead, and the kernels are also summed by kind
(matmuls, attention, norms, ...); then per kind of step (decode, mixed) its span, busy and idle
time, and where inside the mixed steps the device waited.

Requests of --context prompt tokens decode (ignore_eos) until --warmup-steps steps have run
(prefills done, CUDA graphs in use); the next --steps steps are profiled. The table lists each
kernel's GPU µs per step; "busy" is the union of the GPU's kernel intervals over the wall time
of the profiled steps (1.0: the GPU never waited for the host). The engine takes
bench_throughput's options (--attention-backend, --cuda-graph-max-bs, --kernel FIELD=VALUE, ...);
its resolved KernelPlan is printed first.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import benchlib
import torch
from benchlib import MODELS, make_workload, random_tokens, warmup_prompts

from batchrun.engine.engine import Engine
from batchrun.params import GenerateRequest, SamplingParams


def busy_fraction(intervals: list[tuple[float, float]], wall: float) -> float:
    """Union length of [start, end) intervals / wall (same unit)."""
    total, end_max = 0.0, None
    for start, end in sorted(intervals):
        if end_max is None or start > end_max:
            total += end - start
            end_max = end
        elif end > end_max:
            total += end - end_max
            end_max = end
    return total / wall if wall else 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama-1b", help=f"of {', '.join(MODELS)}")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--warmup-steps", type=int, default=40)
    p.add_argument("--steps", type=int, default=32)
    benchlib.add_engine_args(p)
    p.add_argument("--top", type=int, default=25)
    p.add_argument(
        "--checkpoint-format",
        choices=sorted(benchlib.CHECKPOINT_FORMATS),
        help="dummy weights in this format (its quantization_config in config.json)",
    )
    p.add_argument("--workload", help="profile a whole run of this bench_throughput workload")
    p.add_argument("--scale", type=float, default=0.25, help="of the --workload's prompts")
    p.add_argument(
        "--chain",
        action="store_true",
        help="also each kernel's added time in the step's chain (end after the ends before it)",
    )
    args = p.parse_args(argv)

    is_cuda = args.device == "cuda"
    benchlib.set_engine_threads(args.device)
    rng = random.Random(0)
    max_running = args.max_running or (None if args.workload else max(args.batch, 1))
    with tempfile.TemporaryDirectory() as tmp:
        long = args.workload in benchlib.LONG_WORKLOADS  # W5, W6: Llama 3.1's 128k context
        path = benchlib.write_model_dir(
            args.model, Path(tmp), long_context=long, checkpoint_format=args.checkpoint_format
        )
        config = benchlib.engine_config(args, path, max_running=max_running)
        engine = Engine(config, benchlib.kernel_plan(args))
    print(f"kernels: {engine.kernels.describe()}")
    if args.workload:
        return profile_workload(args, engine)
    params = SamplingParams(
        max_new_tokens=args.warmup_steps + args.steps + 8, temperature=0.0, ignore_eos=True
    )
    for i in range(args.batch):
        engine.add_request(GenerateRequest(str(i), random_tokens(rng, args.context), params))
    for _ in range(args.warmup_steps):
        engine.step()
    sync = torch.cuda.synchronize if is_cuda else (lambda: None)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if is_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync()
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        sync()
        wall_us = (time.perf_counter() - t0) * 1e6
    per_kernel, intervals = kernel_times(prof)
    steps = args.steps
    gpu_total = sum(v[0] for v in per_kernel.values())
    launches = sum(v[1] for v in per_kernel.values())
    print(
        f"{args.model} batch {args.batch} context {args.context}: wall {wall_us / steps:.0f} µs"
        f"/step, kernel time {gpu_total / steps:.0f} µs/step, {launches / steps:.0f} launches"
        f"/step, GPU busy {busy_fraction(intervals, wall_us):.2f} of the wall"
    )
    print("| kernel | µs / step | launches / step | share |\n|---|---:|---:|---:|")
    print_table(per_kernel.items(), steps, gpu_total, args.top)
    if args.chain:
        print_chain(cuda_events(prof), steps)
    return 0


def cuda_events(prof) -> list[tuple[float, float, str]]:
    """(start, end, name) of every kernel and copy of a profile, by start (µs)."""
    out = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            start = ev.time_range.start
            out.append((start, start + ev.device_time, ev.name))
    return sorted(out)


def chain_increments(events: list[tuple[float, float, str]]) -> list[float]:
    """Each event's end minus the latest end before it (0 when it ends inside an earlier one):
    what it adds to the chain. With PDL a kernel starts early and waits, so its duration counts
    the wait; the increments of a step still sum to its busy span."""
    out, last_end = [], None
    for _, end, _ in events:
        out.append(0.0 if last_end is None else max(end - last_end, 0.0))
        last_end = end if last_end is None else max(last_end, end)
    return out


def print_chain(events: list[tuple[float, float, str]], steps: int) -> None:
    """The steady step's kernels in order, each with what it adds to the chain (µs, mean over the
    steps): a step of the same kernels repeats, so position i of every step is the same kernel.
    The decoder layers are folded into one row per kernel of a layer (the layer's period found
    from the decode attention's positions)."""
    if not events or len(events) % steps:
        print(f"chain: {len(events)} events do not split into {steps} equal steps")
        return
    period = len(events) // steps
    names = [e[2] for e in events]
    if any(names[i] != names[i % period] for i in range(len(names))):
        print("chain: the steps' kernels differ; no chain report")
        return
    inc = chain_increments(events)
    # the first step's first kernel has no end before it: the mean is of the steps after it
    counted = range(1, steps) if steps > 1 else range(steps)
    mean = [sum(inc[s * period + i] for s in counted) / len(counted) for i in range(period)]
    attn = [i for i in range(period) if "_decode_stage" in names[i] or "BatchDecode" in names[i]]
    layer = attn[1] - attn[0] if len(attn) > 1 else period
    first = attn[0] - 1 if attn else 0  # the layer starts with the matmul before the attention
    last = first + layer * len(attn) if attn else period
    print(
        f"\n| chain position | kernel | adds µs / step (mean of {len(counted)}) |\n|---|---|---:|"
    )
    for i in list(range(first)) + list(range(last, period)):
        print(f"| {i} | {names[i][:80]} | {mean[i]:.2f} |")
    if attn:
        print(f"\n| layer kernel ({len(attn)} layers) | kernel | adds µs / layer |\n|---|---|---:|")
        for j in range(layer):
            vals = [mean[first + n * layer + j] for n in range(len(attn))]
            print(f"| {j} | {names[first + j][:80]} | {sum(vals) / len(vals):.2f} |")
    print(f"| step | | {sum(mean):.1f} |")


def kernel_times(prof) -> tuple[dict[str, list[float]], list[tuple[float, float]]]:
    """(kernel name -> [µs, launches], the kernels' [start, end) intervals) of a profile."""
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    intervals = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = ev.name
        if name.startswith(("Memcpy", "Memset")) or "memcpy" in name.lower():
            name = name.split(" (")[0]
        per_kernel[name][0] += ev.device_time
        per_kernel[name][1] += 1
        start = ev.time_range.start
        intervals.append((start, start + ev.device_time))
    return per_kernel, intervals


def print_table(items, steps: int, gpu_total: float, top: int) -> None:
    """Rows of (name, (µs, launches)), largest first, per step, with their share of gpu_total."""
    ranked = sorted(items, key=lambda kv: -kv[1][0])
    for name, (us, n) in ranked[:top]:
        short = name if len(name) <= 90 else name[:87] + "..."
        print(f"| {short} | {us / steps:.1f} | {n / steps:.1f} | {us / max(gpu_total, 1e-9):.1%} |")
    rest = ranked[top:]
    if rest:
        us = sum(v[0] for _, v in rest)
        print(
            f"| ({len(rest)} more kernels) | {us / steps:.1f} | "
            f"{sum(v[1] for _, v in rest) / steps:.1f} | {us / max(gpu_total, 1e-9):.1%} |"
        )


# kernel kinds by name fragments, first match wins (cuBLAS / CUTLASS matmuls have many names)
KINDS = (
    ("decode attention", ("_decode_stage",)),
    ("extend attention", ("_extend_kernel", "_attend_block")),
    ("flashinfer attention", ("flashinfer", "BatchPrefill", "BatchDecode")),
    ("norm", ("rms_norm", "norm_kernel")),
    ("rotary", ("rotary",)),
    ("kv store", ("store_kv",)),
    ("silu", ("silu",)),
    ("argmax / sampling", ("argmax", "bitmask", "softmax", "topk", "sort")),
    ("matmul", ("gemm", "gemv", "xmma", "cutlass", "sm90_", "splitKreduce", "nvjet", "cublas")),
    ("copies / index", ("Memcpy", "Memset", "copy", "index", "fill", "gather", "scatter")),
)


def kind_of(name: str) -> str:
    for kind, fragments in KINDS:
        if any(f in name for f in fragments):
            return kind
    return "other"


def profile_workload(args, engine) -> int:
    """A whole run of a bench_throughput workload under the profiler: wall time, kernel time by
    kind and by kernel, the GPU's busy fraction."""
    wl = make_workload(args.workload, args.scale)
    params = SamplingParams(max_new_tokens=wl.output_len, temperature=0.0, ignore_eos=True)
    # the warm-up's prompts: the run's lengths, other tokens (none of them cached for the run)
    warm = [GenerateRequest(f"w{i}", p, params) for i, p in enumerate(warmup_prompts(wl, 8))]
    for _ in engine.generate(warm):  # compiles, warms the caches
        pass
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    # NOTE: kernels only on CUDA: a whole run's host ops would swell the trace (and its overhead)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities = [torch.profiler.ProfilerActivity.CUDA]
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(wl.prompts)]
    sync()
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in engine.generate(reqs):
            pass
        sync()
        wall_us = (time.perf_counter() - t0) * 1e6
    per_kernel, intervals = kernel_times(prof)
    gpu_total = sum(v[0] for v in per_kernel.values())
    out_tokens = len(reqs) * wl.output_len
    print(
        f"{args.model} {args.workload} ({wl.note}, {wl.output_len} out): wall {wall_us / 1e6:.2f} s"
        f" ({out_tokens / wall_us * 1e6:,.0f} output tok/s under the profiler), kernel time "
        f"{gpu_total / 1e6:.2f} s, GPU busy {busy_fraction(intervals, wall_us):.2f} of the wall"
    )
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, (us, n) in per_kernel.items():
        by_kind[kind_of(name)][0] += us
        by_kind[kind_of(name)][1] += n
    print("| kind | ms | launches | share |\n|---|---:|---:|---:|")
    for kind, (us, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"| {kind} | {us / 1e3:,.0f} | {n:,} | {us / max(gpu_total, 1e-9):.1%} |")
    print("\n| kernel | µs (whole run) | launches | share |\n|---|---:|---:|---:|")
    print_table(per_kernel.items(), 1, gpu_total, args.top)
    events = cuda_events(prof)
    print_step_kinds(events)
    print_step_gaps(events, "mixed")
    return 0


def print_step_gaps(events: list[tuple[float, float, str]], kind: str, min_gap: float = 10.0):
    """Where the device waits inside the steps of a kind: the gaps of at least min_gap µs
    before an event, summed by the event they precede (mean per step), and the gaps in order
    of the step of that kind that waited longest."""
    steps = [s for s in split_steps(events) if step_kind([n for _, _, n in s]) == kind]
    if not steps:
        return
    by_next: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    timelines = []  # (the step's gaps summed, its gap lines)
    for step in steps:
        last_end, t0, lines, waited = step[0][1], step[0][0], [], 0.0
        for start, end, name in step[1:]:
            gap = start - last_end
            if gap >= min_gap:
                by_next[name[:60]][0] += gap
                by_next[name[:60]][1] += 1
                at = (start - t0) / 1e3
                lines.append(f"  +{at:8.3f} ms  gap {gap:7.1f} µs  before {name[:60]}")
                waited += gap
            last_end = max(last_end, end)
        timelines.append((waited, lines))
    n = len(steps)
    print(f"\n{kind} steps ({n}): gaps of {min_gap:.0f} µs or more, by the event after them")
    print("| event after the gap | µs per step | gaps per step |\n|---|---:|---:|")
    for name, (us, c) in sorted(by_next.items(), key=lambda kv: -kv[1][0])[:15]:
        print(f"| {name} | {us / n:.1f} | {c / n:.1f} |")
    waited, worst = max(timelines, key=lambda t: t[0])
    print(f"the {kind} step that waited longest ({waited / 1e3:.3f} ms in {len(worst)} gaps):")
    print("\n".join(worst[:60]))


def split_steps(events: list[tuple[float, float, str]]) -> list[list[tuple[float, float, str]]]:
    """A run's events (by start; one stream, so in stream order) cut into steps: a step ends
    with the copy of its sampled ids to the host (the one device-to-host copy of a step)."""
    steps, current = [], []
    for ev in events:
        current.append(ev)
        if ev[2].startswith("Memcpy DtoH"):
            steps.append(current)
            current = []
    return steps


def step_kind(names: list[str]) -> str:
    """The kind of a step from its kernels' names: mixed (prefill chunks, with or without
    decodes: an extend kernel ran) or decode."""
    return "mixed" if any("_extend" in n or "BatchPrefill" in n for n in names) else "decode"


def step_kind_rows(events: list[tuple[float, float, str]]) -> dict[str, dict]:
    """Per step kind: steps, span (from the step before's last end to this one's), busy (the
    union of its kernels' intervals within that span) and kernel µs by kind, summed."""
    out: dict[str, dict] = {}
    prev_end = None
    for step in split_steps(events):
        end = max(e for _, e, _ in step)
        if prev_end is not None:
            kind = step_kind([n for _, _, n in step])
            row = out.setdefault(kind, {"steps": 0, "span": 0.0, "busy": 0.0, "kinds": {}})
            row["steps"] += 1
            row["span"] += end - prev_end
            clipped = [(max(s, prev_end), e) for s, e, _ in step if e > prev_end]
            row["busy"] += busy_fraction(clipped, 1.0)
            for s, e, n in step:
                k = kind_of(n)
                row["kinds"][k] = row["kinds"].get(k, 0.0) + (e - s)
        prev_end = end
    return out


def print_step_kinds(events: list[tuple[float, float, str]]) -> None:
    """ms per step of each step kind: span, busy, idle, and kernel time by kind."""
    rows = step_kind_rows(events)
    if not rows:
        return
    kinds = sorted({k for r in rows.values() for k in r["kinds"]})
    print(
        "\n| step kind | steps | span ms | busy ms | idle ms (run) | "
        + " | ".join(kinds)
        + " |\n|---|---:|---:|---:|---:|"
        + "---:|" * len(kinds)
    )
    for kind, r in sorted(rows.items()):
        n = r["steps"]
        cells = " | ".join(f"{r['kinds'].get(k, 0.0) / n / 1e3:.3f}" for k in kinds)
        print(
            f"| {kind} | {n} | {r['span'] / n / 1e3:.3f} | {r['busy'] / n / 1e3:.3f} | "
            f"{(r['span'] - r['busy']) / 1e3:,.1f} | {cells} |"
        )


if __name__ == "__main__":
    sys.exit(main())
