"""W3 latency (batch 1, 512 in / 256 out; BENCH.md) at TP=1 vs TP=2 on dummy Llama weights.

    python scripts/bench_tp.py                                  # llama-8b, TP 1 and 2 (two H200s)
    python scripts/bench_tp.py --models llama-1b,llama-8b --repeats 5
    python scripts/bench_tp.py --device cpu --models tiny --dtype float32 --output-len 16  # smoke

Every TP size runs through batchrun.engine_process.tp_launcher.start_tp_engine (TP=1 too: the
same wrapper, a plain Engine inside), with overlap and CUDA graphs on and the radix cache off, so
each repeat of the one W3 prompt starts cold; the engine options are bench_throughput's
(--attention-backend, --kernel FIELD=VALUE, ...), and each row's resolved KernelPlan is
printed with it. Start-up (weights, graph capture, NCCL) is reported
apart from the timed runs. The greedy tokens of each TP size are compared with TP=1's: bf16
TP=2 may legitimately leave TP=1's path at a near-tie (see tests/gpu/test_tensor_parallel_gpu.py
for the tolerance policy), so the table reports how many leading tokens agree instead of failing.

Prints one markdown row per (model, TP size); the table also goes to --out/bench_tp.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import benchlib
from benchlib import (
    MODELS,
    Device,
    LatencyProbe,
    RunResult,
    fill_latency,
    make_workload,
    run_engine_once,
    warmup_prompts,
)

from batchrun.engine_process.tp_launcher import start_tp_engine
from batchrun.params import GenerateRequest, SamplingParams

HEADER = (
    "| model | TP | ms / output token | decode ms / token | TTFT ms | wall s (repeats) "
    "| tokens equal to TP=1 | peak mem GiB (rank 0) | start-up s |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def engine_config(args, model_dir: Path):
    # the radix cache off: every repeat of the one prompt is a cold run
    return benchlib.engine_config(args, model_dir, enable_radix_cache=False, overlap=True)


def greedy_tokens(engine, prompt: list[int], out_len: int) -> list[int]:
    params = SamplingParams(max_new_tokens=out_len, temperature=0.0, ignore_eos=True)
    (result,) = list(engine.generate([GenerateRequest("check", prompt, params)]))
    return result.output_ids


def bench_one(
    args, model: str, model_dir: Path, tp: int, dev: Device, wl
) -> tuple[RunResult, list]:
    res = RunResult(model, "W3", f"tp{tp}")
    dev.sync()
    t = time.perf_counter()
    kernels = benchlib.kernel_plan(args)
    engine = start_tp_engine(engine_config(args, model_dir), tp, args.base_device, kernels=kernels)
    dev.sync()
    res.startup_s = time.perf_counter() - t
    res.kernels = dataclasses.asdict(engine.kernels)
    probe = None
    try:
        # NOTE: the probe wraps rank 0's Engine, the one that reports results
        probe = LatencyProbe(engine.engine)
        t = time.perf_counter()
        run_engine_once(engine, warmup_prompts(wl, 1), args.warmup_tokens, dev, None)
        res.warmup_s = time.perf_counter() - t
        walls, ttfts_all = [], []
        dev.reset_peak()
        for _ in range(args.repeats):
            wall, bad, done, ttfts, itls = run_engine_once(
                engine, wl.prompts, wl.output_len, dev, probe
            )
            if bad or done != 1:
                res.status, res.note = "bad", f"{bad} bad results, {done} back"
            walls.append(wall)
            ttfts_all.append(ttfts)
        # the median run's figures
        order = sorted(range(len(walls)), key=walls.__getitem__)
        mid = order[len(order) // 2]
        res.walls_s, res.wall_s = walls, walls[mid]
        res.num_requests, res.output_tokens = 1, wl.output_len
        res.prompt_tokens = len(wl.prompts[0])
        res.peak_mem_gib = dev.peak_gib()
        fill_latency(res, ttfts_all[mid], [], wl.output_len)
        tokens = greedy_tokens(engine, wl.prompts[0], wl.output_len)
    finally:
        engine.close()
        del engine, probe  # the probe holds rank 0's Engine: free its weights before the next
        dev.free()
    return res, tokens


def row(r: RunResult, agree: str) -> str:
    def f(v, fmt):
        return "—" if v is None else fmt.format(v)

    walls = ", ".join(f"{w:.2f}" for w in r.walls_s)
    return (
        f"| {r.model} | {r.variant[2:]} | {f(r.ms_per_token, '{:.2f}')} "
        f"| {f(r.decode_ms_per_token, '{:.2f}')} | {f(r.ttft_p50_ms, '{:.1f}')} | {walls} "
        f"| {agree} | {f(r.peak_mem_gib, '{:.1f}')} | {f(r.startup_s, '{:.1f}')} |"
        + (f" {r.status}: {r.note}" if r.status != "ok" else "")
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama-8b", help=f"of {', '.join(MODELS)}")
    p.add_argument("--tp-sizes", default="1,2")
    p.add_argument("--repeats", type=int, default=3, help="timed runs each; the median is shown")
    p.add_argument("--output-len", type=int, default=None, help="default: W3's 256")
    p.add_argument("--base-device", type=int, default=0, help="rank k runs on cuda:base+k")
    # --kv-budget: KV tokens per rank
    benchlib.add_engine_args(p, max_running=8, kv_budget=16384, cuda_graph_max_bs=8)
    p.add_argument("--warmup-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=benchlib.OUT_DIR)
    args = p.parse_args(argv)
    args.models = args.models.split(",")
    args.tp_sizes = [int(t) for t in args.tp_sizes.split(",")]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    dev = Device(args.device)
    env = benchlib.environment(args.device)
    print(json.dumps(env), flush=True)
    wl = make_workload("W3", 1.0)
    if args.output_len:
        wl = dataclasses.replace(wl, output_len=args.output_len)
    tmp = Path(tempfile.mkdtemp(prefix="bench-tp-"))
    lines = [HEADER]
    kernel_lines = []
    ok = True
    for model in args.models:
        model_dir = benchlib.write_model_dir(model, tmp)
        print(f"model {model}: {benchlib.num_params(model) / 1e9:.2f} B params", flush=True)
        ref_tokens = None
        for tp in args.tp_sizes:
            try:
                res, tokens = bench_one(args, model, model_dir, tp, dev, wl)
            except Exception as e:  # report and go on
                traceback.print_exc()
                lines.append(f"| {model} | {tp} | error: {e!r} |"[:300])
                ok = False
                continue
            if tp == 1 or ref_tokens is None:
                ref_tokens, agree = tokens, "(reference)" if tp == 1 else "—"
            else:
                same = next((i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b), None)
                agree = "all" if same is None else f"first {same}"
                agree += f" of {len(tokens)}"
            ok &= res.status == "ok"
            lines.append(row(res, agree))
            kernels = ", ".join(f"{k}={v}" for k, v in res.kernels.items())
            kernel_lines.append(f"- {model} TP={tp}: {kernels}")
            print(lines[-1] + "\n" + kernel_lines[-1], flush=True)
    text = (
        f"W3 latency, TP=1 vs TP=2, {env['date']}, GPU: {env['gpu']} x {max(args.tp_sizes)}, "
        f"torch {env['torch']}, commit {env['commit']}\n\nCommand: `{env['command']}`\n\n"
        + "\n".join(lines)
        + "\n\nKernel configs (resolved):\n"
        + "\n".join(kernel_lines)
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_tp.md").write_text(text + "\n")
    print("\n" + text, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
