"""Throughput sweep on the GPU machine: batchrun (and variants of its config) vs HF `generate`.

    python scripts/bench_throughput.py                                  # the full sweep (BENCH.md)
    python scripts/bench_throughput.py --scale 0.1 --models llama-1b    # a quick check
    python scripts/bench_throughput.py --device cpu --models tiny --workloads W1,W3 \
        --scale 0.005 --variants batchrun,no-overlap,hf                 # CPU smoke test
    python scripts/bench_throughput.py --models llama-8b --workloads W2L --kv-budget 65536 \
        --variants batchrun,prefix-order                                # prefix vs input order
    python scripts/bench_throughput.py --models llama-8b --workloads W3 --repeats 3 \
        --kernel decode_norms=fold-all                                  # one kernel field set
    python scripts/bench_throughput.py --models llama-8b --workloads W1,W3 \
        --variants batchrun,fp8,fp8-block                # bf16, per-channel FP8, block FP8
    python scripts/bench_throughput.py --models llama-8b --workloads W5,W6 \
        --variants batchrun                                             # long documents
    python scripts/bench_throughput.py --models llama-8b --workloads W2 --kv-budget 32768 \
        --kv-budget-same-bytes --variants batchrun,kv-fp8               # FP8 KV: 2x the tokens

Models (dummy weights, written as config.json to a temp dir; benchlib.MODELS): llama-8b,
llama-1b, the mixtures of experts qwen3-30b-a3b, mixtral-8x7b and gpt-oss-20b, gemma-3-4b, the
Gemma 4 shapes gemma-4-dense, gemma-4-e and gemma-4-moe each beside its `-twin` (every layer full,
no KV shared: the KV pool's tokens show what the windows and sharing save), and
`tiny`, for CPU smoke tests). Workloads as BENCH.md defines them (benchlib.make_workload: W1
random, W2 shared prefix, W3 single request, W2L a shared prefix whose distinct tokens exceed a
capped KV pool, W5 long documents 256 x 16,384 -> 128, W6 very long 16 x 131,008 -> 64, run on
llama-8b only; with W5 or W6 the models get Llama 3.1's 128k context, benchlib.LONG_CONTEXT).
Prefill TFLOP/s: the prompts' model FLOPs (linear + causal attention, benchlib.prefill_flops)
over the time to the last request's first token (no shared-prefix workloads); the extend
kernel's own TFLOP/s: scripts/bench_attention_kernels.py --extend-cases
1x16384,1x131072,1x4096+126976.
Variants (VARIANTS): batchrun, the engine as configured by the options (--attention-backend,
--cuda-graph-max-bs, --kernel FIELD=VALUE, ...), and each other variant that config with one
EngineConfig or KernelPlan field changed; hf; prefix-order, batchrun fed in
batchrun.job.order's DFS order with the ordering timed (every other variant takes the prompts in
their given, shuffled, input order). A variant may be named twice (`batchrun,cublas,batchrun`)
to see the drift between runs of one process.

Each engine is built once per (model, variant) (start-up reported apart; its resolved
KernelPlan is logged and written into each row), warmed up on each workload's shape outside
the timed region, and timed on `engine.generate(requests)` between device syncs, with a cold
prefix cache. Each run's figures are printed when it completes and the table + JSON are
rewritten under --out after every run, so a timeout still leaves a partial log.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import benchlib
import torch
from benchlib import (
    MODELS,
    Device,
    LatencyProbe,
    RunResult,
    Workload,
    fill_latency,
    hf_generate,
    make_workload,
    run_engine_once,
    warmup_prompts,
)
from host_phases import HostPhases
from step_trace import StepTrace
from triton_compiles import CompileLog

from batchrun.config import EngineConfig, KernelPlan

# each engine variant: (EngineConfig fields, plan fields) over the options' config and plan
VARIANTS: dict[str, tuple[dict, dict]] = {
    "batchrun": ({}, {}),
    "no-overlap": ({"overlap": False}, {}),
    "no-graph": ({"cuda_graph_max_bs": 0}, {}),
    "no-radix": ({"enable_radix_cache": False}, {}),
    # prefill and mixed steps without / with piecewise CUDA graphs, whatever the default
    "no-piecewise": ({}, {"piecewise_graphs": False}),
    "piecewise": ({}, {"piecewise_graphs": True}),
    # decode matmuls of <= 16 rows on cuBLAS / on kernels/gemv.py
    "cublas": ({}, {"decode_gemv": "cublas"}),
    "triton-gemv": ({}, {"decode_gemv": "triton"}),
    # without programmatic dependent launch; decode_gemv "auto" then takes cuBLAS
    "no-pdl": ({"pdl": False}, {}),
    # the decoder's residual adds and norms in kernels of their own, not inside the gemvs
    "no-norm-fusion": ({}, {"decode_norms": "off"}),
    # every weight U(-1e-3, 1e-3), as vLLM's and SGLang's dummy loaders draw them
    "dummy-uniform": ({"dummy_init": "uniform"}, {}),
    # the model's linears in FP8 (per-channel weights, dynamic per-token activations), as
    # --quantization fp8 makes them
    "fp8": ({"quantization": "fp8"}, {}),
    # dummy weights in a checkpoint format (VARIANT_QUANTIZATION): FP8 in 128 x 128 blocks,
    # activations per token in groups of 128 (`quant_method: fp8` with weight_block_size); INT4
    # in AWQ's layout on kernels/int4_matmul.py / dequantized to bf16 at load / the default
    # (a model whose bf16 weights fit: dequantized, decode batches on the packed copy)
    "fp8-block": ({}, {"fp8_matmul": "scaled_mm"}),
    "fp8-block-dequant": ({}, {"fp8_matmul": "dequant"}),
    # block FP8 kept in FP8 with the FP8 KV cache
    "fp8-block-kv-fp8": ({"kv_cache_dtype": "fp8_e4m3"}, {"fp8_matmul": "scaled_mm"}),
    "int4-awq": ({}, {"int4_matmul": "triton"}),
    "int4-awq-dequant": ({}, {"int4_matmul": "dequant"}),
    "int4-awq-auto": ({}, {}),
    # per-channel FP8 decode batches on torch._scaled_mm (auto: kernels/fp8_gemv.py)
    "fp8-cublas": ({"quantization": "fp8"}, {"decode_gemv": "cublas"}),
    # a mixture of experts' decode batches on the grouped GEMMs (auto: the router in one kernel,
    # the experts on kernels/moe_gemv.py)
    "moe-grouped": ({}, {"moe_decode": "grouped"}),
    # a mixture of experts' prefill batches on kernels/fused_moe.py's Triton grouped GEMMs (auto
    # on sm_90: torch._grouped_mm, kernels/moe_grouped_mm.py)
    "moe-triton-prefill": ({}, {"moe_prefill": "triton"}),
    # prefill and mixed steps' extend rows on kernels/extend_attention.py (auto on Hopper with
    # flashinfer: FlashInfer's FA3 prefill)
    "extend-triton": ({}, {"extend_attention": "triton"}),
    # the KV cache in float8_e4m3fn (--kv-cache-dtype fp8_e4m3): one byte an element
    "kv-fp8": ({"kv_cache_dtype": "fp8_e4m3"}, {}),
    # `fp8` with torch._scaled_mm's sums promoted to fp32 (KernelPlan.fp8_fast_accum off)
    "fp8-promoted": ({"quantization": "fp8"}, {"fp8_fast_accum": False}),
    # FP8 as an FP8 checkpoint runs with vLLM's or TensorRT-LLM's FP8 KV cache: the linears as
    # `fp8` and the KV cache as `kv-fp8`
    "fp8-kv-fp8": ({"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}, {}),
    "prefix-order": ({}, {}),
}
# the quantization_config a variant's config.json carries (dummy weights in that format)
VARIANT_QUANTIZATION = {
    "fp8-block": benchlib.CHECKPOINT_FORMATS["fp8-block"],
    "int4-awq": benchlib.CHECKPOINT_FORMATS["awq"],
    "int4-awq-dequant": benchlib.CHECKPOINT_FORMATS["awq"],
    "int4-awq-auto": benchlib.CHECKPOINT_FORMATS["awq"],
    "fp8-block-dequant": benchlib.CHECKPOINT_FORMATS["fp8-block"],
    "fp8-block-kv-fp8": benchlib.CHECKPOINT_FORMATS["fp8-block"],
}
ALL_VARIANTS = (*VARIANTS, "hf")
# BENCH.md targets: (workload, model) -> bound; W3 is ms per output token (lower is better), the
# others output tok/s (higher is better)
TARGETS = {
    ("W1", "llama-8b"): 11000,
    ("W1", "llama-1b"): 50000,
    ("W2", "llama-8b"): 11500,
    ("W2", "llama-1b"): 40000,
    ("W3", "llama-8b"): 4.2,
    ("W3", "llama-1b"): 1.0,
}


# -- batchrun -------------------------------------------------------------------------------------


def engine_config(args, model_dir: Path, variant: str) -> tuple[EngineConfig, KernelPlan]:
    """The variant's EngineConfig (the options' config, overlap on, with its fields changed)
    and its plan overrides: Engine(*engine_config(...))."""
    engine_fields, kernel_fields = VARIANTS[variant]
    config = benchlib.engine_config(args, model_dir, **{"overlap": True, **engine_fields})
    kernels = benchlib.kernel_plan(args, kernel_fields)
    if args.kv_budget_same_bytes and config.kv_budget and config.kv_cache_dtype != "auto":
        # the bytes of --kv-budget tokens in the compute dtype, in one-byte elements
        size = torch.empty(0, dtype=getattr(torch, benchlib.dtype_name(args))).element_size()
        config = dataclasses.replace(config, kv_budget=config.kv_budget * size)
    return config, kernels


def bench_engine(args, engine, res: RunResult, wl: Workload, dev: Device, probe) -> None:
    cache = getattr(getattr(engine, "kv", None), "cache", None)
    compiles = args.compile_log
    if compiles is not None:
        compiles.phase = "warm-up"
    t = time.perf_counter()
    run_engine_once(engine, warmup_prompts(wl, args.warmup_requests), args.warmup_tokens, dev, None)
    benchlib.warm_expert_tiles(engine)
    res.warmup_s = time.perf_counter() - t
    if compiles is not None:
        compiles.phase = "timed"
    walls, last = [], None
    phases = HostPhases(engine) if args.phases else None
    trace = StepTrace(engine) if args.step_trace else None
    steps_at_start = engine.stats.num_steps
    for _ in range(args.repeats):
        if cache is not None:
            cache.reset()  # every timed run starts with a cold prefix cache
        stats = engine.stats
        before = (stats.prompt_tokens, stats.cached_tokens, stats.output_tokens, stats.num_steps)
        retracted_before = getattr(getattr(engine, "scheduler", None), "num_retractions", 0)
        fwd_before = engine.runner.forward_time
        dev.reset_peak()
        if trace is not None and trace.run_start is None:  # the first repeat's (steps add up)
            trace.run_start = time.perf_counter()
        wall, bad, done, ttfts, itls = run_engine_once(
            engine, wl.prompts, wl.output_len, dev, probe, order=res.variant == "prefix-order"
        )
        if trace is not None:
            trace.run_end = time.perf_counter()
        walls.append(wall)
        last = (wall, bad, done, ttfts, itls, before, fwd_before, retracted_before)
    wall, bad, done, ttfts, itls, before, fwd_before, retracted_before = last
    stats = engine.stats
    if trace is not None:
        trace.close()
        log(f"  [{res.model} {wl.name} {res.variant}] " + trace.report())
    if phases is not None:
        phases.close()
        took = phases.take(sum(walls), stats.num_steps - steps_at_start)
        log(
            f"  [{res.model} {wl.name} {res.variant}] main thread ms/step: "
            + HostPhases.format(took)
        )
    res.walls_s = walls
    res.wall_s = statistics.median(walls)
    res.num_requests = done
    res.prompt_tokens = stats.prompt_tokens - before[0]
    res.output_tokens = stats.output_tokens - before[2]
    res.cached_fraction = (stats.cached_tokens - before[1]) / max(res.prompt_tokens, 1)
    res.num_steps = stats.num_steps - before[3]
    res.forward_occupancy = (engine.runner.forward_time - fwd_before) / wall
    res.output_tok_s = res.output_tokens / res.wall_s
    res.total_tok_s = (res.prompt_tokens + res.output_tokens) / res.wall_s
    res.peak_mem_gib = dev.peak_gib()
    res.kv_slots = getattr(engine, "num_kv_slots", None)
    window = getattr(getattr(engine, "runner", None), "window", None)
    res.window_requests = window.max_requests if window is not None else None
    if getattr(engine, "scheduler", None) is not None:
        res.retractions = engine.scheduler.num_retractions - retracted_before
    fill_latency(res, ttfts, itls, wl.output_len)
    if ttfts and not wl.name.startswith("W2") and benchlib.is_llama_shape(res.model):
        # no prefix shared (every prompt token computed); a dense Llama (benchlib.linear_shapes)
        flops = benchlib.prefill_flops(res.model, [len(p) for p in wl.prompts])
        res.prefill_tflops = flops / max(ttfts) / 1e12
    if not probe or not probe.active:
        res.note = "TTFT/ITL not measured (no hook)"
    distinct = len({tuple(p[:2048]) for p in wl.prompts}) * 2048
    if wl.name == "W2L" and res.kv_slots is not None and res.kv_slots >= distinct:
        res.note += f" KV pool {res.kv_slots:,} holds all {distinct:,} prefix tokens: cap it"
    if bad or done != len(wl.prompts):
        res.status = "bad"
        res.note = f"{bad} results with an error or a wrong length; {done}/{len(wl.prompts)} back"
    if compiles is not None:
        # NOTE: a Triton compile inside the timed run stalls it (scripts/triton_compiles.py):
        # such a row measures the compiler too, and says so
        log(
            f"  [{res.model} {wl.name} {res.variant}] Triton variants built: start-up "
            f"{compiles.summary('start-up')}; warm-up {compiles.summary('warm-up')}; timed "
            f"{compiles.summary('timed')}"
        )
        if compiles.take("timed"):
            res.note = f"{res.note}; compiled in the timed run: {compiles.summary('timed')}"
            for event in compiles.take("timed"):  # what start-up would have to build
                log(f"    timed-run compile, {event.seconds:.2f} s: {event.detail or event.kernel}")
        compiles.reset()
        compiles.phase = "between runs"


# -- HF transformers baseline ------------------------------------------------------------------


def load_hf(model_dir: Path, args, dev: Device):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    dtype = getattr(torch, benchlib.dtype_name(args))
    # random weights, built on the device directly (an 8B init on the CPU takes minutes)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=args.hf_attn
        )
    return model.to(args.device).eval()


def _step_clock(dev: Device):
    from transformers import LogitsProcessor

    class StepClock(LogitsProcessor):
        """Marks when each decode step's logits are ready: CUDA events, so no extra host sync."""

        def __init__(self):
            self.marks: list = []

        def mark(self) -> None:
            if dev.is_cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self.marks.append(ev)
            else:
                self.marks.append(time.perf_counter())

        def __call__(self, input_ids, scores):
            self.mark()
            return scores

        def seconds(self) -> list[float]:
            """Each mark's time since the first one (call after a sync)."""
            if dev.is_cuda:
                return [self.marks[0].elapsed_time(ev) / 1e3 for ev in self.marks]
            return [t - self.marks[0] for t in self.marks]

    return StepClock()


@torch.inference_mode()
def run_hf_once(model, prompts, out_len: int, batch_size: int, dev: Device, clock=None):
    from transformers import LogitsProcessorList

    spans: list[tuple[int, int, int]] = []  # (num prompts, first mark, end mark) per batch
    bad = 0
    dev.sync()
    if clock is not None:
        clock.mark()
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        first = len(clock.marks) if clock is not None else 0
        processors = LogitsProcessorList([clock] if clock is not None else [])
        out, width = hf_generate(model, chunk, out_len, 0, logits_processor=processors)
        bad += len(chunk) * (out.shape[1] - width != out_len)
        spans.append((len(chunk), first, len(clock.marks) if clock is not None else 0))
    dev.sync()
    wall = time.perf_counter() - t0
    ttfts, itls = [], []
    if clock is not None:
        secs = clock.seconds()
        for n, first, end in spans:
            if end > first:
                ttfts += [secs[first]] * n
                if end - first > 1:
                    itls += [(secs[end - 1] - secs[first]) / (end - first - 1)] * n
    return wall, bad, ttfts, itls


def bench_hf(args, model, res: RunResult, wl: Workload, dev: Device) -> None:
    prompts = wl.prompts[: args.hf_max_prompts]
    if len(prompts) < len(wl.prompts):
        res.note = f"first {len(prompts)} of {len(wl.prompts)} prompts"
    t = time.perf_counter()
    run_hf_once(model, warmup_prompts(wl, min(8, args.hf_batch_size)), 4, 8, dev)
    res.warmup_s = time.perf_counter() - t
    walls = []
    for _ in range(args.repeats):
        dev.reset_peak()
        clock = _step_clock(dev)
        wall, bad, ttfts, itls = run_hf_once(
            model, prompts, wl.output_len, args.hf_batch_size, dev, clock
        )
        walls.append(wall)
    res.walls_s = walls
    res.wall_s = statistics.median(walls)
    res.num_requests = len(prompts)
    res.prompt_tokens = sum(len(p) for p in prompts)
    res.output_tokens = len(prompts) * wl.output_len
    res.output_tok_s = res.output_tokens / res.wall_s
    res.total_tok_s = (res.prompt_tokens + res.output_tokens) / res.wall_s
    res.peak_mem_gib = dev.peak_gib()
    fill_latency(res, ttfts, itls, wl.output_len)
    if bad:
        res.status = "bad"
        res.note = f"{bad} sequences with a wrong length"


# -- report --------------------------------------------------------------------------------------


def _f(value, fmt: str = "{:,.0f}") -> str:
    return "—" if value is None else fmt.format(value)


def detail_table(results: list[RunResult]) -> str:
    head = (
        "| model | workload | variant | status | requests | output tok/s | total tok/s "
        "| ms/token (decode) | TTFT p50 / p99 ms | ITL p50 ms | GPU fwd occupancy "
        "| prefill TFLOP/s | cached fraction | peak mem GiB | steps | start-up s | wall s "
        "| note |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        ms = (
            f"{r.ms_per_token:.2f} ({_f(r.decode_ms_per_token, '{:.2f}')})"
            if r.ms_per_token is not None
            else "—"
        )
        ttft = (
            f"{r.ttft_p50_ms:,.1f} / {r.ttft_p99_ms:,.1f}"
            if r.ttft_p50_ms is not None
            else "not measured"
        )
        walls = ", ".join(f"{w:.2f}" for w in r.walls_s) or "—"
        lines.append(
            f"| {r.model} | {r.workload} | {r.variant} | {r.status} | {r.num_requests} "
            f"| {_f(r.output_tok_s)} | {_f(r.total_tok_s)} | {ms} | {ttft} "
            f"| {_f(r.itl_p50_ms, '{:.2f}')} | {_f(r.forward_occupancy, '{:.2f}')} "
            f"| {_f(r.prefill_tflops, '{:.1f}')} | {_f(r.cached_fraction, '{:.3f}')} "
            f"| {_f(r.peak_mem_gib, '{:.1f}')} "
            f"| {_f(r.num_steps)} | {_f(r.startup_s, '{:.1f}')} | {walls} | {r.note} |"
        )
    return "\n".join(lines)


def summary_table(results: list[RunResult], variants: list[str], skipped: list[str]) -> str:
    """BENCH.md's layout: one row per (workload, model), one column per variant (a variant run
    more than once shows each run's figure, in order)."""
    columns = list(dict.fromkeys(variants))
    keys = list(dict.fromkeys((r.workload, r.model) for r in results))
    lines = [
        "| workload | " + " | ".join(columns) + " | target |",
        "|---|" + "---|" * (len(columns) + 1),
    ]
    for wl, model in keys:
        what = "ms / output token" if wl == "W3" else "output tok/s"
        if wl.startswith("W2"):
            what += " (cached fraction)"
        cells = []
        for v in columns:
            runs = [r for r in results if (r.workload, r.model, r.variant) == (wl, model, v)]
            if not runs:
                cells.append("skipped" if f"{model}/{wl}/{v}" in skipped else "—")
                continue
            cells.append(", ".join(summary_cell(r) for r in runs))
        target = TARGETS.get((wl, model))
        tcell = "—" if target is None else (f"≤ {target}" if wl == "W3" else f"≥ {target:,}")
        lines.append(f"| {wl}, {model}, {what} | " + " | ".join(cells) + f" | {tcell} |")
    return "\n".join(lines)


def summary_cell(r: RunResult) -> str:
    if r.wall_s is None:
        return r.status
    cell = f"{r.ms_per_token:.2f}" if r.workload == "W3" else f"{r.output_tok_s:,.0f}"
    if r.workload.startswith("W2") and r.cached_fraction is not None:
        cell += f" ({r.cached_fraction:.3f})"
    return cell if r.status == "ok" else f"{cell} [{r.status}]"


def kernel_lines(results: list[RunResult]) -> str:
    """Each engine's resolved KernelPlan, once per (model, variant)."""
    seen = {}
    for r in results:
        if r.kernels is not None:
            seen.setdefault((r.model, r.variant), r.kernels)
    return "\n".join(
        f"- {model} {variant}: " + ", ".join(f"{k}={v}" for k, v in kernels.items())
        for (model, variant), kernels in seen.items()
    )


def write_report(out: Path, env: dict, results, variants, skipped: list[str]) -> str:
    header = (
        f"Throughput sweep, {env['date']}, GPU: {env['gpu']}, torch {env['torch']}, "
        f"transformers {env['transformers']}, commit {env['commit']}\n\n"
        f"Command: `{env['command']}`"
    )
    kernels = kernel_lines(results)
    text = "\n\n".join(
        [header, detail_table(results), summary_table(results, variants, skipped)]
        + ([f"Kernel configs (resolved):\n{kernels}"] if kernels else [])
        + ([f"Skipped (time budget): {', '.join(skipped)}"] if skipped else [])
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_throughput.md").write_text(text + "\n")
    payload = {"env": env, "results": [dataclasses.asdict(r) for r in results], "skipped": skipped}
    (out / "bench_throughput.json").write_text(json.dumps(payload, indent=2) + "\n")
    return text


# -- main --------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama-1b,llama-8b", help=f"of {', '.join(MODELS)}")
    p.add_argument("--workloads", default="W1,W2,W3")
    p.add_argument(
        "--variants", default="batchrun,no-overlap,no-graph,hf",
        help=f"comma-separated, of {', '.join(ALL_VARIANTS)}",
    )  # fmt: skip
    p.add_argument("--scale", type=float, default=1.0, help="fraction of prompts (W2: groups)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs each; the median is shown")
    benchlib.add_engine_args(p)
    p.add_argument("--warmup-requests", type=int, default=32)
    p.add_argument("--warmup-tokens", type=int, default=8)
    p.add_argument("--hf-batch-size", type=int, default=256)
    p.add_argument("--hf-max-prompts", type=int, default=512, help="HF runs the first N prompts")
    p.add_argument("--hf-attn", default="eager", help="HF attn_implementation (BENCH.md: eager)")
    p.add_argument(
        "--phases",
        action="store_true",
        help="time the engine's main-thread phases per step (scripts/host_phases.py); print them",
    )
    p.add_argument(
        "--step-trace",
        action="store_true",
        help="each step's forward and the device's gap before it, by kind (scripts/step_trace.py)",
    )
    p.add_argument("--no-latency-probe", action="store_true", help="no TTFT/ITL hook in batchrun")
    p.add_argument(
        "--no-compile-log",
        action="store_true",
        help="do not hook Triton's JIT to report the kernel variants built in each phase",
    )
    p.add_argument("--time-budget", type=float, default=None, help="seconds; skip runs after it")
    p.add_argument(
        "--kv-budget-same-bytes",
        action="store_true",
        help="--kv-budget counts tokens of a cache in the compute dtype: a kv-fp8 variant gets "
        "the same bytes (twice the tokens in bf16), so the capacity shows in a capped run",
    )
    p.add_argument("--out", type=Path, default=benchlib.OUT_DIR)
    args = p.parse_args(argv)
    args.models = args.models.split(",")
    args.workloads = args.workloads.split(",")
    args.variants = args.variants.split(",")
    for name, allowed in (("model", MODELS), ("variant", ALL_VARIANTS)):
        for v in getattr(args, name + "s"):
            if v not in allowed:
                p.error(f"unknown {name} {v!r}; known: {', '.join(allowed)}")
    return args


def log(msg: str) -> None:
    print(msg, flush=True)


def format_run(r: RunResult) -> str:
    parts = [f"[{r.model} {r.workload} {r.variant}] {r.status}"]
    if r.wall_s is not None:
        parts.append(
            f"{r.num_requests} req, wall {r.wall_s:.2f}s, out {r.output_tok_s:,.0f} tok/s, "
            f"total {r.total_tok_s:,.0f} tok/s"
        )
    if r.ms_per_token is not None:
        parts.append(
            f"{r.ms_per_token:.2f} ms/token (decode {_f(r.decode_ms_per_token, '{:.2f}')})"
        )
    if r.ttft_p50_ms is not None:
        parts.append(f"TTFT p50 {r.ttft_p50_ms:,.1f} p99 {r.ttft_p99_ms:,.1f} ms")
    if r.itl_p50_ms is not None:
        parts.append(f"ITL p50 {r.itl_p50_ms:.2f} ms")
    if r.forward_occupancy is not None:
        parts.append(f"fwd occupancy {r.forward_occupancy:.2f}")
    if r.prefill_tflops is not None:
        parts.append(f"prefill {r.prefill_tflops:.1f} TFLOP/s")
    if r.cached_fraction is not None:
        parts.append(f"cached {r.cached_fraction:.3f}")
    if r.peak_mem_gib is not None:
        parts.append(f"peak {r.peak_mem_gib:.1f} GiB")
    if r.num_steps is not None:
        parts.append(f"{r.num_steps} steps")
    if r.kv_slots is not None:
        # a 16k-token request holds 16,384 of the pool's tokens (with the sliding layers' window
        # pool, engine/window_pool.py, the pool is the full layers' and each request holds a
        # window apart: the window pool bounds the requests too)
        pool, held = f"KV pool {r.kv_slots:,} tokens", r.kv_slots / 16384
        if r.window_requests is not None:
            pool += f", windows of {r.window_requests} requests"
            held = min(held, r.window_requests)
        parts.append(f"{pool} ({held:.1f} x 16k requests)")
    if r.retractions is not None:
        parts.append(f"{r.retractions} retractions")
    if r.warmup_s is not None:
        parts.append(f"warm-up {r.warmup_s:.1f}s")
    if r.note:
        parts.append(r.note)
    return ", ".join(parts)


def variant_model_dir(model_dir: Path, variant: str) -> Path:
    """model_dir, or a sibling whose config.json adds the variant's quantization_config."""
    qcfg = VARIANT_QUANTIZATION.get(variant)
    if qcfg is None:
        return model_dir
    path = model_dir.with_name(f"{model_dir.name}-{variant}")
    path.mkdir(exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = qcfg
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def start(args, model_dir: Path, variant: str, dev: Device):
    """The variant's engine (or HF model), its start-up seconds and its resolved kernels."""
    from batchrun.engine.engine import Engine

    model_dir = variant_model_dir(model_dir, variant)
    dev.sync()
    t = time.perf_counter()
    if variant == "hf":
        target, kernels = load_hf(model_dir, args, dev), None
    else:
        target = Engine(*engine_config(args, model_dir, variant))
        kernels = dataclasses.asdict(target.kernels)
    dev.sync()
    return target, time.perf_counter() - t, kernels


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    args.compile_log = None
    if args.device == "cuda" and not args.no_compile_log:
        args.compile_log = CompileLog.install()
    dev = Device(args.device)
    env = benchlib.environment(args.device)
    log(json.dumps(env))
    workloads = {}
    for name in args.workloads:
        workloads[name] = make_workload(name, args.scale)
        log(f"workload {name}: {workloads[name].note}, {workloads[name].output_len} out")
    results: list[RunResult] = []
    skipped: list[str] = []

    def over_budget() -> bool:
        return args.time_budget is not None and time.perf_counter() - t_start > args.time_budget

    def record(r: RunResult) -> None:
        results.append(r)
        log(format_run(r))
        write_report(args.out, env, results, args.variants, skipped)

    tmp = Path(tempfile.mkdtemp(prefix="bench-models-"))
    for model in args.models:
        long = any(w in benchlib.LONG_WORKLOADS for w in args.workloads)
        model_dir = benchlib.write_model_dir(model, tmp, long_context=long)
        log(f"model {model}: {benchlib.num_params(model) / 1e9:.2f} B params, {model_dir}")
        for variant in args.variants:
            names = [w for w in args.workloads if not (variant == "hf" and w.startswith("W2"))]
            for w in args.workloads:
                if variant == "hf" and w.startswith("W2"):
                    log(f"[{model} {w} hf] skipped: HF generate has no prefix cache (BENCH.md)")
            if not names:
                continue
            if over_budget():
                skipped += [f"{model}/{w}/{variant}" for w in names]
                continue
            if args.compile_log is not None:
                args.compile_log.reset()  # phase "start-up"
            try:
                target, startup, kernels = start(args, model_dir, variant, dev)
            except Exception as e:  # report and go on with the sweep
                traceback.print_exc()
                for w in names:
                    record(RunResult(model, w, variant, "error", f"start-up: {e!r}"[:200]))
                dev.free()
                continue
            described = "" if kernels is None else f"; kernels: {target.kernels.describe()}"
            log(f"[{model} {variant}] start-up {startup:.1f}s{described}")
            probe = None
            if variant != "hf" and not args.no_latency_probe:
                probe = LatencyProbe(target)
            for w in names:
                if over_budget():
                    skipped.append(f"{model}/{w}/{variant}")
                    continue
                res = RunResult(model, w, variant, startup_s=startup, kernels=kernels)
                try:
                    if variant == "hf":
                        bench_hf(args, target, res, workloads[w], dev)
                    else:
                        bench_engine(args, target, res, workloads[w], dev, probe)
                except Exception as e:
                    traceback.print_exc()
                    res.status, res.note = "error", repr(e)[:200]
                record(res)
            del target, probe
            dev.free()  # two 8b models never coexist
    if args.compile_log is not None:
        args.compile_log.close()
    text = write_report(args.out, env, results, args.variants, skipped)
    if skipped:
        log(f"skipped (time budget {args.time_budget}s exceeded): {', '.join(skipped)}")
    log(f"\ntotal {time.perf_counter() - t_start:.0f}s; written to {args.out}/bench_throughput.*\n")
    log(text)
    return 0 if all(r.status == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
