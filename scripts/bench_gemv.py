"""Decode GEMVs on the GPU: cuBLAS (F.linear) against kernels/gemv.py, per weight shape of the
benchmark models, with a sweep of the kernel's tile configs. Answers whether the Triton kernel
should replace cuBLAS at small M (batch-1 decode, W3), and with which config per shape.

    python scripts/bench_gemv.py                              # llama-1b and llama-8b, M = 1, 4
    python scripts/bench_gemv.py --models llama-1b --m 1 --no-sweep
    python scripts/bench_gemv.py --norm-fusion               # the add + norm inside the matmul

Each measurement replays a CUDA graph of many calls (no launch overhead, as in the engine's
decode graphs) that cycle through enough copies of the weight to exceed the L2 cache, so every
call reads its weight from HBM. Reports µs per call and the weight bytes per second, and per
model the sum over one decode step (layers x [qkv, o, gate_up, down] + lm_head); for gate_up also
the SwiGLU as gemv's epilogue against cuBLAS's matmul + the gate's kernel (what decode_gemv
"cublas" runs). The kernel runs with programmatic dependent launch where the GPU has it
(`pdl=`, kernels/pdl.py; sm_90+); the default config is also timed without. A graph of GEMVs
only overstates what PDL gives in a model, where small kernels (norms, rotary, attention) sit
between the matmuls. Every config is checked against F.linear first (bf16: relative error
<= 1e-2); one that is off is reported and skipped. Writes the figures as JSON under --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import benchlib
import torch
import torch.nn.functional as F

from batchrun.engine.kernel_choice import supports_pdl

L2_BYTES = 256 << 20  # read more than this per graph: the H200's L2 is 50 MB
CALLS_PER_GRAPH = 64


def graph_time_us(fn, weights: list[torch.Tensor]) -> float:
    """µs per call of fn(w) over a captured graph that cycles through `weights`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            fn(w)  # warm-up: compiles, allocates
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    order = [weights[i % len(weights)] for i in range(CALLS_PER_GRAPH)]
    with torch.cuda.graph(graph):
        for w in order:
            fn(w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 5
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (reps * CALLS_PER_GRAPH)


def configs(sweep: bool):
    from batchrun.kernels.gemv import GemvConfig

    if not sweep:
        return []
    grid = itertools.product((16, 32, 64), (128, 256, 512), (1, 2, 3, 4, 6, 8), (4,))
    return [GemvConfig(bn, bk, sk, nw) for bn, bk, sk, nw in grid]


def worth_sweeping(cfg, n: int, k: int) -> bool:
    """Skip configs that split nothing (K slices of less than a tile) or split a matrix whose
    column tiles alone fill the GPU twice over."""
    if cfg.split_k == 1:
        return True
    return cfg.block_k * cfg.split_k <= k and -(-n // cfg.block_n) < 264


def bench_swiglu(x, weights: list[torch.Tensor], sweep: bool, pdl: bool) -> dict:
    """gate_up with the SwiGLU as gemv's epilogue against cuBLAS's matmul then the gate's
    kernel; with sweep, the epilogue's configs too."""
    from batchrun.kernels.activation import silu_and_mul
    from batchrun.kernels.gemv import gemv

    w0 = weights[0]
    ref = silu_and_mul(F.linear(x, w0)).float()
    fused = gemv(x, w0, swiglu=True, pdl=pdl).float()
    out = {
        "swiglu_error": ((fused - ref).norm() / ref.norm()).item(),
        "cublas_silu_us": graph_time_us(lambda w: silu_and_mul(F.linear(x, w), pdl=pdl), weights),
        "swiglu_us": graph_time_us(lambda w: gemv(x, w, swiglu=True, pdl=pdl), weights),
    }
    timed = []
    n, k = w0.shape[0] // 2, w0.shape[1]
    for cfg in configs(sweep):
        if cfg.block_n > 32 or not worth_sweeping(cfg, n, k):
            continue
        us = graph_time_us(lambda w, cfg=cfg: gemv(x, w, cfg, swiglu=True, pdl=pdl), weights)
        timed.append((list(cfg), us))
    out["swiglu_top_configs"] = sorted(timed, key=lambda item: item[1])[:6]
    return out


def bench_shape(n: int, k: int, m: int, sweep: bool, dtype, pdl: bool, swiglu=False) -> dict:
    from batchrun.kernels.gemv import gemv, pick_config

    copies = max(2, -(-L2_BYTES // (n * k * dtype.itemsize)))
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w0 = weights[0]
    ref = F.linear(x, w0).float()
    gb = n * k * dtype.itemsize / 1e9

    def check(cfg) -> bool:
        out = gemv(x, w0, cfg, pdl=pdl).float()
        return ((out - ref).norm() / ref.norm()).item() <= 1e-2

    out = {"cublas_us": graph_time_us(lambda w: F.linear(x, w), weights)}
    default = pick_config(m, n, k)
    out["default_config"] = list(default)
    out["default_us"] = graph_time_us(lambda w: gemv(x, w, default, pdl=pdl), weights)
    # the same config without programmatic dependent launch (kernels/pdl.py): each call of the
    # graph then starts only once the one before has drained
    out["default_no_pdl_us"] = graph_time_us(lambda w: gemv(x, w, default, pdl=False), weights)
    best, best_us, bad, timed = default, out["default_us"], [], []
    for cfg in configs(sweep):
        if not worth_sweeping(cfg, n, k):
            continue
        if not check(cfg):
            bad.append(list(cfg))
            continue
        us = graph_time_us(lambda w, cfg=cfg: gemv(x, w, cfg, pdl=pdl), weights)
        timed.append((list(cfg), us))
        if us < best_us:
            best, best_us = cfg, us
    out.update(best_config=list(best), best_us=best_us, wrong_configs=bad)
    out["top_configs"] = sorted(timed, key=lambda item: item[1])[:6]
    out["default_correct"] = check(default)
    if swiglu:
        out.update(bench_swiglu(x, weights, sweep, pdl))
    for key in ("cublas", "default", "best"):
        out[f"{key}_tb_s"] = gb / (out[f"{key}_us"] * 1e-6) / 1e3
    weights.clear()
    torch.cuda.empty_cache()
    return out


def bench_norm_fusion(model: str, dtype, pdl: bool) -> list[dict]:
    """A decoder layer's matmul pairs around its norms, as the engine runs a one-row decode
    batch: o_proj -> add + RMSNorm -> gate_up (+ SwiGLU), and down_proj -> add + RMSNorm -> qkv;
    unfused (gemv, fused_add_rms_norm, gemv) against the add and the norm inside the first
    matmul (gemv_residual: its last column tile normalizes the row); and the first matmul alone,
    plain and as gemv_residual (what the in-kernel norm adds to it)."""
    dims = {name: (n, k) for name, n, k, _ in benchlib.linear_shapes(model)}
    return [bench_norm_pair(dims, first, second, dtype, pdl)
            for first, second in (("o", "gate_up"), ("down", "qkv"))]  # fmt: skip


def bench_norm_pair(dims: dict, first: str, second: str, dtype, pdl: bool) -> dict:
    from batchrun.kernels.fused_norm import fused_add_rms_norm
    from batchrun.kernels.gemv import gemv, gemv_residual

    (n1, k1), (n2, k2) = dims[first], dims[second]
    swiglu = second == "gate_up"
    copies = max(2, -(-L2_BYTES // ((n1 * k1 + n2 * k2) * dtype.itemsize)))
    pairs = [
        (torch.randn(n1, k1, device="cuda", dtype=dtype) * 0.02,
         torch.randn(n2, k2, device="cuda", dtype=dtype) * 0.02)
        for _ in range(copies)
    ]  # fmt: skip
    norm = (torch.ones(n1, device="cuda", dtype=dtype), 1e-5)
    residual = torch.randn(1, n1, device="cuda", dtype=dtype)
    x = torch.randn(1, k1, device="cuda", dtype=dtype)

    def unfused(ws):
        # NOTE: in place on y and on a residual that grows by y every call: finite for the few
        # hundred calls timed here
        y, _ = fused_add_rms_norm(gemv(x, ws[0], pdl=pdl), residual, *norm, pdl=pdl)
        return gemv(y, ws[1], swiglu=swiglu, pdl=pdl)

    def fused(ws):
        _, normed = gemv_residual(x, ws[0], residual, norm=norm, pdl=pdl)
        return gemv(normed, ws[1], swiglu=swiglu, pdl=pdl)

    row = {
        "pair": f"{first} -> {second}",
        "unfused_us": graph_time_us(unfused, pairs),
        "fused_us": graph_time_us(fused, pairs),
        f"{first}_us": graph_time_us(lambda ws: gemv(x, ws[0], pdl=pdl), pairs),
        f"{first}_add_norm_us": graph_time_us(
            lambda ws: gemv_residual(x, ws[0], residual, norm=norm, pdl=pdl), pairs
        ),
    }
    pairs.clear()
    torch.cuda.empty_cache()
    return row


def main_norm_fusion(args, dtype, pdl: bool, report: dict) -> None:
    for model in args.models.split(","):
        print(f"\n{model}, M = 1: residual add + RMSNorm inside the matmul before (µs a call)")
        for r in bench_norm_fusion(model, dtype, pdl):
            r.update(model=model, m=1)
            report.setdefault("norm_fusion", []).append(r)
            cells = [f"{k} {v:.1f}" if isinstance(v, float) else str(v)
                     for k, v in r.items() if k not in ("model", "m")]  # fmt: skip
            print("  " + ", ".join(cells), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="llama-1b,llama-8b")
    p.add_argument("--m", default="1,4", help="rows of x (decode batch), comma-separated")
    p.add_argument("--no-sweep", action="store_true", help="only cuBLAS and the default config")
    p.add_argument("--matrices", default="qkv,o,gate_up,down,lm_head", help="which of each model's")
    p.add_argument(
        "--norm-fusion", action="store_true",
        help="only the add + norm inside the gemv before it against its own kernel (M = 1)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=benchlib.OUT_DIR)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemv: needs a CUDA GPU (the kernel is Triton; cuBLAS is the baseline)")
        return 0
    dtype = torch.bfloat16
    pdl = supports_pdl(torch.device("cuda"))
    report = {"device": torch.cuda.get_device_name(), "pdl": pdl, "results": []}
    if args.norm_fusion:
        main_norm_fusion(args, dtype, pdl, report)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_gemv.json").write_text(json.dumps(report, indent=2) + "\n")
        return 0
    for model in args.models.split(","):
        for m in (int(v) for v in args.m.split(",")):
            totals = {"cublas": 0.0, "default": 0.0, "best": 0.0}
            print(f"\n{model}, M = {m}")
            print(
                "| matrix | N x K | cuBLAS µs (TB/s) | default µs (no PDL) | best µs (TB/s) "
                "| best config |"
            )
            print("|---|---|---|---|---|---|")
            for name, n, k, count in benchlib.linear_shapes(model):
                if name not in args.matrices.split(","):
                    continue
                sweep = not args.no_sweep
                r = bench_shape(n, k, m, sweep, dtype, pdl, swiglu=name == "gate_up")
                r.update(model=model, m=m, matrix=name, n=n, k=k, count=count)
                report["results"].append(r)
                for key in totals:
                    totals[key] += count * r[f"{key}_us"]
                flag = "" if r["default_correct"] else " (WRONG)"
                print(
                    f"| {name} | {n} x {k} | {r['cublas_us']:.1f} ({r['cublas_tb_s']:.2f}) | "
                    f"{r['default_us']:.1f}{flag} ({r['default_no_pdl_us']:.1f}) | "
                    f"{r['best_us']:.1f} ({r['best_tb_s']:.2f}) | "
                    f"{tuple(r['best_config'])} |",
                    flush=True,
                )
                top = ", ".join(f"{tuple(c)} {us:.1f}" for c, us in r["top_configs"])
                print(f"    top: {top}", flush=True)
                if "swiglu_us" in r:
                    top = ", ".join(f"{tuple(c)} {us:.1f}" for c, us in r["swiglu_top_configs"])
                    print(
                        f"    SwiGLU: cuBLAS + gate {r['cublas_silu_us']:.1f}, epilogue "
                        f"{r['swiglu_us']:.1f} µs (rel. error {r['swiglu_error']:.1e}); top: {top}",
                        flush=True,
                    )
            print(
                f"per decode step: cuBLAS {totals['cublas']:.0f} µs, default "
                f"{totals['default']:.0f} µs, best per shape {totals['best']:.0f} µs"
            )
            report.setdefault("step_totals", []).append({"model": model, "m": m, **totals})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_gemv.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
