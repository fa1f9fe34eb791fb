"""Throughput sweep on the GPU machine: batchrun (and switched-off variants) vs HF `generate`.

    python scripts/bench_throughput.py                                  # the full sweep (BENCH.md)
    python scripts/bench_throughput.py --scale 0.1 --models llama-1b    # a quick check
    python scripts/bench_throughput.py --device cpu --models tiny --workloads W1,W3 \
        --scale 0.005 --variants batchrun,no-overlap,hf                 # CPU smoke test
    python scripts/bench_throughput.py --models llama-8b --workloads W2L --kv-budget 65536 \
        --variants batchrun,prefix-order                                # prefix vs input order

Models (dummy weights, written as config.json to a temp dir): llama-8b, llama-1b (and `tiny`,
for CPU smoke tests). Workloads as BENCH.md defines them (W1 random, W2 shared prefix, W3 single
request; W2L: W2-large, whose distinct prefix tokens exceed a capped KV pool). Variants:
batchrun (overlap + CUDA graphs), no-overlap, no-graph, no-radix, flashinfer (batchrun with the
FlashInfer attention backend), gemv (batchrun with BATCHRUN_GEMV=triton: kernels/gemv.py for the
large decode matmuls), the decode kernel switches of VARIANT_ENV (no-norm-fusion,
graph-input-copies, no-fold, ...: each turns one fusion off), no-piecewise / piecewise
(batchrun with piecewise CUDA graphs for prefill and mixed steps off / on whatever the
default), hf, and prefix-order (batchrun fed in batchrun.job.order's DFS order, ordering timed;
every other variant takes the prompts in their given, shuffled, input order).

Each engine is built once per (model, variant) (start-up reported apart), warmed up on each
workload's shape outside the timed region, and timed on `engine.generate(requests)` between
device syncs, with a cold prefix cache. Each run's figures are printed when it completes and the
table + JSON are rewritten under --out after every run, so a timeout still leaves a partial log.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing batchrun

from batchrun.kernels.gemv import GEMV_PEEL_ENV  # noqa: E402
from batchrun.kernels.pdl import PDL_ENV  # noqa: E402
from bench_models import MODELS, num_params, write_model_dir  # noqa: E402
from host_phases import HostPhases  # noqa: E402
from source_tree import git_commit  # noqa: E402
from step_trace import StepTrace  # noqa: E402
from triton_compiles import CompileLog  # noqa: E402

from batchrun.attention.flashinfer_backend import PREFILL_KERNELS_ENV  # noqa: E402
from batchrun.attention.triton_backend import (  # noqa: E402
    DECODE_EVICT_ENV,
    DECODE_FOLD_ENV,
    DECODE_GRID_ENV,
    DECODE_ROPE_ENV,
)
from batchrun.engine.cuda_graph import GRAPH_INPUTS_ENV  # noqa: E402
from batchrun.engine.kv_pool import ROTARY_STORE_ENV  # noqa: E402
from batchrun.engine.sampler import ARGMAX_MAX_ROWS_ENV  # noqa: E402
from batchrun.models.layers import (  # noqa: E402
    DUMMY_INIT_ENV,
    GEMV_ENV,
    GEMV_NORM_ENV,
    GEMV_SWIGLU_ENV,
)

VARIANTS = (
    "batchrun",
    "no-overlap",
    "no-graph",
    "no-radix",
    "flashinfer",
    "flashinfer-fa3",
    "gemv",
    "gemv-all",
    "cublas",
    "triton-gemv",
    "no-pdl",
    "gemv-all-no-pdl",
    "no-swiglu-gemv",
    "no-fold",
    "no-rotary-store",
    "no-decode-rope",
    "unfused-decode",
    "no-norm-fusion",
    "norm-fusion",
    "post-norm-fusion",
    "fold-norm-fusion",
    "fold-all-norm-fusion",
    "graph-input-copies",
    "gemv-peel-1",
    "torch-argmax",
    "decode-rows-first",
    "decode-evict-first",
    "dummy-uniform",
    "no-piecewise",
    "piecewise",
    "hf",
    "prefix-order",
)
# the variants that differ by a kernel switch (models/layers.py, kernels/pdl.py)
VARIANT_ENV = {
    "gemv": {GEMV_ENV: "triton"},
    "gemv-all": {GEMV_ENV: "all"},
    "no-pdl": {PDL_ENV: "0"},  # and so cuBLAS decode matmuls (auto takes gemv only with PDL)
    "gemv-all-no-pdl": {GEMV_ENV: "all", PDL_ENV: "0"},
    "no-swiglu-gemv": {GEMV_SWIGLU_ENV: "0"},  # the SwiGLU gate in its own kernel
    "no-fold": {DECODE_FOLD_ENV: "0"},  # decode attention's split combine as a second kernel
    "no-rotary-store": {ROTARY_STORE_ENV: "0"},  # rotary and the KV store as two kernels
    # decode steps rotate and store in kernels/rotary_kv_store.py, not in the decode kernel
    "no-decode-rope": {DECODE_ROPE_ENV: "0"},
    # the seventh session's decode kernels: each of this session's three fusions off
    "unfused-decode": {GEMV_SWIGLU_ENV: "0", DECODE_FOLD_ENV: "0", ROTARY_STORE_ENV: "0"},
    # the decoder's residual adds and norms in kernels of their own, not inside the gemvs
    "no-norm-fusion": {GEMV_NORM_ENV: "0"},
    "norm-fusion": {GEMV_NORM_ENV: "1"},  # also for models wider than GEMV_NORM_MAX_HIDDEN
    "post-norm-fusion": {GEMV_NORM_ENV: "post"},  # only the norm after the attention
    # "post", and each input norm inside the qkv matmul (gemv_rms on folded weights)
    "fold-norm-fusion": {GEMV_NORM_ENV: "fold"},
    # "fold", and each post-attention norm inside gate_up's matmul (o_proj adds the residual)
    "fold-all-norm-fusion": {GEMV_NORM_ENV: "fold-all"},
    # the decode graphs' inputs by copies and index kernels, not kernels/graph_inputs.py
    "graph-input-copies": {GRAPH_INPUTS_ENV: "0"},
    "gemv-peel-1": {GEMV_PEEL_ENV: "1"},  # one weight tile a gemv program before its PDL wait
    # greedy steps of more than 16 rows take torch's argmax (the default before 2026-12-01)
    "torch-argmax": {ARGMAX_MAX_ROWS_ENV: "16"},
    # the decode attention's grid with a KV head's requests adjacent (the order before
    # 2026-12-01); its KV loads evicting first
    "decode-rows-first": {DECODE_GRID_ENV: "rows"},
    "decode-evict-first": {DECODE_EVICT_ENV: "evict_first"},
    # every weight U(-1e-3, 1e-3), as vLLM's and SGLang's dummy loaders draw them (models/layers.py)
    "dummy-uniform": {DUMMY_INIT_ENV: "uniform"},
    # the flashinfer backend with its prefill wrapper on FlashAttention-3 kernels
    "flashinfer-fa3": {PREFILL_KERNELS_ENV: "fa3"},
}
# NOTE: every switch any variant sets is cleared around each engine (only GEMV and PDL were, so
# a variant's other switches leaked into the engines after it in the same run)
VARIANT_ENV_KEYS = sorted({key for env in VARIANT_ENV.values() for key in env})
TOKEN_LOW, TOKEN_HIGH = 1000, 30000
# BENCH.md targets: (workload, model) -> (figure, bound); W3 is ms per output token (lower is
# better), the others output tok/s (higher is better)
TARGETS = {
    ("W1", "llama-8b"): 11000,
    ("W1", "llama-1b"): 50000,
    ("W2", "llama-8b"): 11500,
    ("W2", "llama-1b"): 40000,
    ("W3", "llama-8b"): 4.2,
    ("W3", "llama-1b"): 1.0,
}


# -- workloads ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_len: int
    note: str


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]


def make_workload(name: str, scale: float) -> Workload:
    """BENCH.md's workloads; --scale shrinks the number of prompts (W2: groups), never lengths."""
    if name == "W1":
        rng = random.Random(0)
        n = max(1, round(2000 * scale))
        return Workload(name, [_tokens(rng, 512) for _ in range(n)], 256, f"{n} x 512 in")
    if name == "W2":
        rng = random.Random(1)
        groups = max(1, round(32 * scale))
        prompts = []
        for _ in range(groups):
            prefix = _tokens(rng, 1024)
            prompts.extend(prefix + _tokens(rng, 128) for _ in range(32))
        rng.shuffle(prompts)
        return Workload(name, prompts, 128, f"{groups} groups x 32, 1024+128 in")
    if name == "W3":
        return Workload(name, [_tokens(random.Random(3), 512)], 256, "1 x 512 in")
    if name == "W2L":
        # W2-large: 64 groups x 32 questions over 2,048-token prefixes = 131,072 distinct prefix
        # tokens; run it with --kv-budget 65536 (or less) so that they cannot all stay cached:
        # prefix order (variant prefix-order) vs input order (batchrun) is then the figure
        rng = random.Random(2)
        groups = max(1, round(64 * scale))
        prompts = []
        for _ in range(groups):
            prefix = _tokens(rng, 2048)
            prompts.extend(prefix + _tokens(rng, 128) for _ in range(32))
        rng.shuffle(prompts)
        return Workload(name, prompts, 128, f"{groups} groups x 32, 2048+128 in, shuffled")
    raise ValueError(f"unknown workload {name!r}; known: W1, W2, W3, W2L")


def warmup_prompts(workload: Workload, num: int) -> list[list[int]]:
    """Prompts of the workload's lengths with other tokens (no prefix-cache hits on the real
    ones)."""
    rng = random.Random(1234)
    return [_tokens(rng, len(p)) for p in workload.prompts[:num]]


# -- figures -------------------------------------------------------------------------------------


@dataclass
class RunResult:
    model: str
    workload: str
    variant: str
    status: str = "ok"  # ok | skipped | error | bad (wrong output lengths)
    note: str = ""
    num_requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    wall_s: float | None = None  # median over repeats
    walls_s: list[float] = field(default_factory=list)
    output_tok_s: float | None = None
    total_tok_s: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    ms_per_token: float | None = None  # W3: wall / output_len
    decode_ms_per_token: float | None = None  # W3: (wall - TTFT) / (output_len - 1)
    forward_occupancy: float | None = None
    cached_fraction: float | None = None
    peak_mem_gib: float | None = None
    num_steps: int | None = None
    kv_slots: int | None = None  # the engine's KV pool, in tokens
    retractions: int | None = None  # requests sent back to the queue for KV (recomputed)
    startup_s: float | None = None
    warmup_s: float | None = None


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def fill_latency(res: RunResult, ttfts: list[float], itls: list[float], out_len: int) -> None:
    if ttfts:
        res.ttft_p50_ms = 1e3 * statistics.median(ttfts)
        res.ttft_p99_ms = 1e3 * percentile(ttfts, 99)
    if itls:
        res.itl_p50_ms = 1e3 * statistics.median(itls)
    if res.workload == "W3" and res.wall_s:
        res.ms_per_token = 1e3 * res.wall_s / out_len
        if ttfts and out_len > 1:
            res.decode_ms_per_token = 1e3 * (res.wall_s - ttfts[0]) / (out_len - 1)


class Device:
    def __init__(self, name: str):
        self.type = name
        self.is_cuda = name == "cuda"

    def sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float | None:
        return torch.cuda.max_memory_allocated() / 2**30 if self.is_cuda else None

    def free(self) -> None:
        gc.collect()
        if self.is_cuda:
            torch.cuda.empty_cache()


# -- batchrun -------------------------------------------------------------------------------------


def engine_config(args, model_dir: Path, variant: str):
    from batchrun.config import EngineConfig

    cfg = EngineConfig(
        model=str(model_dir),
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        max_running=args.max_running,
        kv_budget=args.kv_budget,
        overlap=True,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        chunked_prefill_size=args.chunked_prefill_size,
        page_size=args.page_size,
    )
    # NOTE: the variants of VARIANT_ENV change no config: main() sets their switches around the
    # engine's life (each had to be listed here too, and one left out failed at start-up)
    changes = {
        "batchrun": {},
        "no-overlap": {"overlap": False},
        "no-graph": {"cuda_graph_max_bs": 0},
        "no-radix": {"enable_radix_cache": False},
        "flashinfer": {"attention_backend": "flashinfer"},
        "flashinfer-fa3": {"attention_backend": "flashinfer"},  # and FA3 prefill (VARIANT_ENV)
        "no-piecewise": {"piecewise_cuda_graph": False},
        "piecewise": {"piecewise_cuda_graph": True},  # also where it is off by default
        "cublas": {"decode_gemv": "cublas"},  # decode matmuls on cuBLAS (large models' default)
        "triton-gemv": {"decode_gemv": "triton"},  # on kernels/gemv.py (small models' default)
        "prefix-order": {},
        **{name: {} for name in VARIANT_ENV if name != "flashinfer-fa3"},
    }[variant]
    return replace(cfg, **changes)


class LatencyProbe:
    """Host time at which each request's first token reached the host.

    NOTE: GenerateResult carries no timestamps and results arrive only at finish, so this wraps
    the engine's per-step result processing (`_process`, once per step; a scan of the step's
    output indices). Under overlap, step n is processed after step n+1 is launched: that is when
    the host sees the token, so it is what a caller would measure too.
    """

    def __init__(self, engine):
        self.first: dict[tuple[str, int], float] = {}
        original = getattr(engine, "_process", None)
        self.active = callable(original)
        if not self.active:
            return

        def process(launched, *args, **kwargs):
            # (returns a grammar step's fill job, which step() needs)
            fill = original(launched, *args, **kwargs)
            out_index = getattr(launched, "out_index", None)
            if out_index and 0 in out_index:
                now = time.perf_counter()
                for req, idx in zip(launched.reqs, out_index):
                    if idx == 0:
                        self.first.setdefault((req.rid, req.index), now)
            return fill

        engine._process = process


def run_engine_once(
    engine, prompts, out_len: int, dev: Device, probe: LatencyProbe | None, order: bool = False
):
    from batchrun.params import GenerateRequest, SamplingParams
    from batchrun.job.order import order_items

    params = SamplingParams(
        max_new_tokens=out_len, min_new_tokens=out_len, temperature=0.0, ignore_eos=True
    )
    requests = [GenerateRequest(str(i), ids, params) for i, ids in enumerate(prompts)]
    if probe is not None:
        probe.first.clear()
    finish: dict[tuple[str, int], float] = {}
    bad = 0
    dev.sync()
    t0 = time.perf_counter()
    if order:  # what `batchrun submit --order prefix` does, timed with the run
        requests = order_items(requests, lambda r: r.input_ids)
    for result in engine.generate(requests):
        finish[(result.rid, result.index)] = time.perf_counter()
        if result.error or result.completion_tokens != out_len:
            bad += 1
    dev.sync()
    wall = time.perf_counter() - t0
    ttfts, itls = [], []
    if probe is not None and probe.active:
        for key, t_end in finish.items():
            t_first = probe.first.get(key)
            if t_first is None:
                continue
            ttfts.append(t_first - t0)
            if out_len > 1:
                itls.append((t_end - t_first) / (out_len - 1))
    return wall, bad, len(finish), ttfts, itls


def bench_engine(args, engine, res: RunResult, wl: Workload, dev: Device, probe) -> None:
    cache = getattr(getattr(engine, "kv", None), "cache", None)
    compiles = getattr(args, "compile_log", None)
    if compiles is not None:
        compiles.phase = "warm-up"
    t = time.perf_counter()
    run_engine_once(engine, warmup_prompts(wl, args.warmup_requests), args.warmup_tokens, dev, None)
    res.warmup_s = time.perf_counter() - t
    if compiles is not None:
        compiles.phase = "timed"
    walls, last = [], None
    phases = HostPhases(engine) if args.phases else None
    trace = StepTrace(engine) if getattr(args, "step_trace", False) else None
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
    if getattr(engine, "scheduler", None) is not None:
        res.retractions = engine.scheduler.num_retractions - retracted_before
    fill_latency(res, ttfts, itls, wl.output_len)
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
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else None
    dtype = dtype or (torch.bfloat16 if dev.is_cuda else torch.float32)
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
        width = max(len(p) for p in chunk)
        input_ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=dev.type)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=dev.type)
        first = len(clock.marks) if clock is not None else 0
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=out_len,
            min_new_tokens=out_len,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([clock] if clock is not None else []),
        )
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
        "| cached fraction | peak mem GiB | steps | start-up s | wall s | note |"
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
            f"| {_f(r.cached_fraction, '{:.3f}')} | {_f(r.peak_mem_gib, '{:.1f}')} "
            f"| {_f(r.num_steps)} | {_f(r.startup_s, '{:.1f}')} | {walls} | {r.note} |"
        )
    return "\n".join(lines)


def summary_table(results: list[RunResult], variants: list[str], skipped: list[str]) -> str:
    """BENCH.md's layout: one row per (workload, model), one column per variant."""
    keys = list(dict.fromkeys((r.workload, r.model) for r in results))
    lines = [
        "| workload | " + " | ".join(variants) + " | target |",
        "|---|" + "---|" * (len(variants) + 1),
    ]
    for wl, model in keys:
        what = "ms / output token" if wl == "W3" else "output tok/s"
        if wl.startswith("W2"):
            what += " (cached fraction)"
        cells = []
        for v in variants:
            r = next(
                (r for r in results if (r.workload, r.model, r.variant) == (wl, model, v)), None
            )
            if r is None or r.wall_s is None:
                gone = f"{model}/{wl}/{v}" in skipped
                cells.append(r.status if r is not None else ("skipped" if gone else "—"))
                continue
            cell = f"{r.ms_per_token:.2f}" if wl == "W3" else f"{r.output_tok_s:,.0f}"
            if wl.startswith("W2") and r.cached_fraction is not None:
                cell += f" ({r.cached_fraction:.3f})"
            if r.status != "ok":
                cell += f" [{r.status}]"
            cells.append(cell)
        target = TARGETS.get((wl, model))
        tcell = "—" if target is None else (f"≤ {target}" if wl == "W3" else f"≥ {target:,}")
        lines.append(f"| {wl}, {model}, {what} | " + " | ".join(cells) + f" | {tcell} |")
    return "\n".join(lines)


def environment(args) -> dict:
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "none (CPU)"
    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "gpu": gpu,
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "commit": git_commit(),
        "command": "python " + " ".join(sys.argv),
    }


def _version(package: str) -> str:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:
        return "not installed"


def write_report(out: Path, env: dict, results, variants, skipped: list[str]) -> str:
    header = (
        f"Throughput sweep, {env['date']}, GPU: {env['gpu']}, torch {env['torch']}, "
        f"transformers {env['transformers']}, commit {env['commit']}\n\n"
        f"Command: `{env['command']}`"
    )
    text = "\n\n".join(
        [header, detail_table(results), summary_table(results, variants, skipped)]
        + ([f"Skipped (time budget): {', '.join(skipped)}"] if skipped else [])
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_throughput.md").write_text(text + "\n")
    payload = {"env": env, "results": [asdict(r) for r in results], "skipped": skipped}
    (out / "bench_throughput.json").write_text(json.dumps(payload, indent=2) + "\n")
    return text


# -- main --------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama-1b,llama-8b", help=f"of {', '.join(MODELS)}")
    p.add_argument("--workloads", default="W1,W2,W3")
    p.add_argument("--variants", default="batchrun,no-overlap,no-graph,hf", help=f"of {VARIANTS}")
    p.add_argument("--scale", type=float, default=1.0, help="fraction of prompts (W2: groups)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs each; the median is shown")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--max-running", type=int, default=None, help="default: the engine's")
    p.add_argument("--cuda-graph-max-bs", type=int, default=512)
    p.add_argument(
        "--chunked-prefill-size",
        type=lambda v: v if v == "auto" else int(v),
        default="auto",
        help="prefill tokens a step (default: the engine's)",
    )
    p.add_argument(
        "--decode-config",
        default=None,
        help="BLOCK_N,WARPS,STAGES of the Triton decode attention kernel (default: its own)",
    )
    p.add_argument("--kv-budget", type=int, default=None, help="KV tokens; default from memory")
    p.add_argument("--page-size", type=int, default=1, help="KV slots allocated together")
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
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench-out"))
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.models = args.models.split(",")
    args.workloads = args.workloads.split(",")
    args.variants = args.variants.split(",")
    for name, allowed in (("model", MODELS), ("variant", VARIANTS)):
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
    if r.cached_fraction is not None:
        parts.append(f"cached {r.cached_fraction:.3f}")
    if r.peak_mem_gib is not None:
        parts.append(f"peak {r.peak_mem_gib:.1f} GiB")
    if r.num_steps is not None:
        parts.append(f"{r.num_steps} steps")
    if r.kv_slots is not None:
        parts.append(f"KV pool {r.kv_slots:,} tokens")
    if r.retractions is not None:
        parts.append(f"{r.retractions} retractions")
    if r.warmup_s is not None:
        parts.append(f"warm-up {r.warmup_s:.1f}s")
    if r.note:
        parts.append(r.note)
    return ", ".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    args.compile_log = None
    if args.device == "cuda" and not args.no_compile_log:
        args.compile_log = CompileLog.install()
    if args.decode_config:  # the kernel reads its module defaults at every launch
        from batchrun.kernels import decode_attention

        bn, warps, stages = (int(x) for x in args.decode_config.split(","))
        decode_attention.DEFAULT_BLOCK_N = bn
        decode_attention.DEFAULT_NUM_WARPS = warps
        decode_attention.DEFAULT_NUM_STAGES = stages
    dev = Device(args.device)
    env = environment(args)
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
        model_dir = write_model_dir(model, tmp)
        log(f"model {model}: {num_params(model) / 1e9:.2f} B params, {model_dir}")
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
            target = None
            # NOTE: the switches are read per call, and once at capture for the decode graphs, so
            # they are set for the whole life of this variant's engine and cleared before the next
            for key in VARIANT_ENV_KEYS:
                os.environ.pop(key, None)
            os.environ.update(VARIANT_ENV.get(variant, {}))
            if args.compile_log is not None:
                args.compile_log.reset()  # phase "start-up"
            try:
                dev.sync()
                t = time.perf_counter()
                if variant == "hf":
                    target = load_hf(model_dir, args, dev)
                else:
                    from batchrun.engine.engine import Engine

                    target = Engine(engine_config(args, model_dir, variant))
                dev.sync()
                startup = time.perf_counter() - t
                log(f"[{model} {variant}] start-up {startup:.1f}s")
            except Exception as e:  # report and go on with the sweep
                traceback.print_exc()
                for w in names:
                    record(RunResult(model, w, variant, "error", f"start-up: {e!r}"[:200]))
                del target
                dev.free()
                continue
            probe = None
            if variant != "hf" and not args.no_latency_probe:
                probe = LatencyProbe(target)
            for w in names:
                if over_budget():
                    skipped.append(f"{model}/{w}/{variant}")
                    continue
                res = RunResult(model, w, variant, startup_s=startup)
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
            for key in VARIANT_ENV_KEYS:
                os.environ.pop(key, None)
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
