"""Data parallel throughput: --dp 1 vs 2 (vs N) engine processes on one node, same workload.

    python scripts/bench_dp.py --model llama-1b --workload W1 --dp 1,2
    python scripts/bench_dp.py --device cpu --model tiny --scale 0.002 --dp 1 --warmup 2   # smoke

Every setting runs through the same path: DataParallelEngine (batchrun/engine_process/) with dp
engine processes (on GPUs 0..dp-1), fed from this process with the workload's requests, routed by
prefix group and load. The engine options are bench_throughput's (--attention-backend, --kernel
FIELD=VALUE, ...); the engines' resolved KernelPlan is printed. Each setting is warmed up
(kernels compiled, graphs captured at start-up) before the timed region; the figure is output
tok/s over the whole workload, tail included. Prints a markdown table with the speed-up over the
first setting.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import benchlib
from benchlib import greedy_params, make_workload, warmup_prompts

from batchrun.config import EngineConfig, KernelPlan
from batchrun.engine.engine import drive
from batchrun.engine_process.data_parallel import DataParallelEngine
from batchrun.params import GenerateRequest


def drive_workload(dp: DataParallelEngine, prompts: list[list[int]], out_len: int, tag: str):
    """Every prompt through the engines; returns the output tokens generated."""
    params = greedy_params(out_len)
    requests = (GenerateRequest(f"{tag}{i}", p, params) for i, p in enumerate(prompts))
    return sum(r.completion_tokens for r in drive(dp, requests))


def run(cfg: EngineConfig, dp: int, wl, warm: int) -> dict:
    devices = list(range(dp)) if cfg.device == "cuda" else None
    t0 = time.perf_counter()
    with DataParallelEngine(cfg, dp, device_indices=devices, load_tokenizer=False) as eng:
        start_s = time.perf_counter() - t0
        drive_workload(eng, warmup_prompts(wl, warm * dp), 32, "w")
        t = time.perf_counter()
        tokens = drive_workload(eng, wl.prompts, wl.output_len, "r")
        elapsed = time.perf_counter() - t
        routed = list(eng.routed)
        kernels = eng.kernels.describe()
    return {"dp": dp, "tok_s": tokens / elapsed, "elapsed": elapsed, "start_s": start_s,
            "routed": routed, "kernels": kernels}  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--workload", default="W1")
    ap.add_argument("--dp", default="1,2")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=64, help="warm-up requests per engine")
    benchlib.add_engine_args(ap)
    args = ap.parse_args(argv)
    if benchlib.kernel_plan(args) != KernelPlan():
        ap.error("the data-parallel engines run their own plans: no --attention-backend, --kernel")
    wl = make_workload(args.workload, args.scale)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = benchlib.write_model_dir(args.model, Path(tmp))
        cfg = benchlib.engine_config(args, model_dir)
        rows = [run(cfg, int(d), wl, args.warmup) for d in args.dp.split(",")]
    base = rows[0]["tok_s"]
    dtype = benchlib.dtype_name(args)
    print(f"\n{args.workload} ({wl.note}, {wl.output_len} out), {args.model}, dummy {dtype}\n")
    print(
        "| engines (--dp) | output tok/s | vs first | wall s | start-up s | requests per engine |"
    )
    print("|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['dp']} | {r['tok_s']:,.0f} | {r['tok_s'] / base:.2f}x | {r['elapsed']:.1f} | "
              f"{r['start_s']:.0f} | {r['routed']} |")  # fmt: skip
    print(f"\nkernels (resolved): {rows[0]['kernels']}")


if __name__ == "__main__":
    main()
