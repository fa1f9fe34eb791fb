"""Where a decode step's GPU time goes: the engine's steady decode under torch.profiler, kernel
time per step by kernel, the number of launches, and the GPU's busy fraction of the wall time.

    python scripts/profile_decode.py --model llama-8b --batch 1            # W3's step
    python scripts/profile_decode.py --model llama-1b --batch 256          # W1's decode step
    python scripts/profile_decode.py --device cpu --model tiny --batch 4   # CPU smoke test

Requests of --context prompt tokens decode (ignore_eos) until --warmup-steps steps have run
(prefills done, CUDA graphs in use); the next --steps steps are profiled. The table lists each
kernel's GPU µs per step; "busy" is the union of the GPU's kernel intervals over the wall time
of the profiled steps (1.0: the GPU never waited for the host).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_models import MODELS, write_model_dir  # noqa: E402


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
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)

    from batchrun.engine.config import EngineConfig
    from batchrun.engine.engine import Engine
    from batchrun.engine.params import GenerateRequest, SamplingParams

    is_cuda = args.device == "cuda"
    if is_cuda:
        from batchrun.engine_process.worker import GPU_ENGINE_THREADS

        torch.set_num_threads(GPU_ENGINE_THREADS)  # as in the product's engine process
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model_dir(args.model, Path(tmp))
        engine = Engine(
            EngineConfig(
                model=str(path),
                load_format="dummy",
                device=args.device,
                dtype="bfloat16" if is_cuda else "float32",
                max_running=max(args.batch, 1),
                attention_backend=args.attention_backend,
            )
        )
    params = SamplingParams(
        max_new_tokens=args.warmup_steps + args.steps + 8, temperature=0.0, ignore_eos=True
    )
    for i in range(args.batch):
        prompt = [rng.randrange(1000, 30000) for _ in range(args.context)]
        engine.add_request(GenerateRequest(str(i), prompt, params))
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
    steps = args.steps
    gpu_total = sum(v[0] for v in per_kernel.values())
    launches = sum(v[1] for v in per_kernel.values())
    print(
        f"{args.model} batch {args.batch} context {args.context}: wall {wall_us / steps:.0f} µs"
        f"/step, kernel time {gpu_total / steps:.0f} µs/step, {launches / steps:.0f} launches"
        f"/step, GPU busy {busy_fraction(intervals, wall_us):.2f} of the wall"
    )
    print("| kernel | µs / step | launches / step | share |\n|---|---:|---:|---:|")
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])
    for name, (us, n) in ranked[: args.top]:
        short = name if len(name) <= 90 else name[:87] + "..."
        print(f"| {short} | {us / steps:.1f} | {n / steps:.1f} | {us / max(gpu_total, 1e-9):.1%} |")
    rest = ranked[args.top :]
    if rest:
        us = sum(v[0] for _, v in rest)
        print(
            f"| ({len(rest)} more kernels) | {us / steps:.1f} | "
            f"{sum(v[1] for _, v in rest) / steps:.1f} | {us / max(gpu_total, 1e-9):.1%} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
