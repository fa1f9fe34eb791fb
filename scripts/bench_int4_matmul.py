"""The INT4 W4A16 matmul (kernels/int4_matmul.py) against bf16 F.linear (cuBLAS) on the GPU, per
projection of the benchmark models and per M, with an optional sweep of tile configs; on the
weight in mma_pack's order too (what an engine layer keeps), and above 16 rows the weight
dequantized into a scratch buffer by int4_dequantize then cuBLAS (a candidate); at M <= 16
also the decode GEMVs: the Gluon MMA GEMV on mma_pack-ed weights (kernels/int4_gemv_mma.py,
what QuantMatmul runs there), kernels/int4_gemv.py (for weights the first does not take; at
M = 1 its CUDA-core kernel, pick_fma_config) and the bf16 decode GEMV (kernels/gemv.py), µs
and TB/s of weight bytes. Answers whether the kernel's config table (`CONFIGS`, `pick_config`)
holds on this GPU, and what INT4 weights give over bf16 at decode (memory-bound: GB/s of weight
bytes) and prefill (TFLOP/s).

    python scripts/bench_int4_matmul.py                          # llama-8b, M = 1 ... 8192
    python scripts/bench_int4_matmul.py --models llama-8b,llama-1b --m 1,16 --sweep
    python scripts/bench_int4_matmul.py --m 1,16 --sweep gemv     # the GEMV's configs only
    python scripts/bench_int4_matmul.py --m 1 --sweep fma         # the CUDA-core GEMV's only
    python scripts/bench_int4_matmul.py --m 1 --sweep mma         # the tensor-core GEMV's splits
    python scripts/bench_int4_matmul.py --m 1,4,16                # the decode columns

Weights are AWQ-shaped (group 128, zero points; random values). Each measurement replays a CUDA
graph of calls (no launch overhead, as in the engine's graphs) that cycle through enough copies
of the weight to exceed the L2 cache, timed with CUDA events; the kernel and cuBLAS are timed in
the same run. Each config is checked against F.linear(x, W_bf16) first (relative error <= 1e-2);
one that is off is reported and skipped. Per model, the sum over one decode step's matmuls
(layers x [qkv, o, gate_up, down]) at M = 1 is printed for both. Writes JSON under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import benchlib
import torch
import torch.nn.functional as F
from batchrun.kernels.gemv import gemv
from batchrun.kernels.int4_gemv import MAX_M as GEMV_MAX_M
from batchrun.kernels.int4_gemv import Int4GemvConfig, int4_gemv, pick_dot_config, pick_fma_config
from batchrun.kernels.int4_gemv_mma import int4_gemv_mma
from batchrun.kernels.int4_gemv_mma import takes as mma_takes
from batchrun.kernels.int4_matmul import (
    CONFIGS,
    Int4Config,
    int4_dequantize,
    int4_matmul,
    pick_config,
    prepare,
)

from batchrun.quant.dummy import random_int4
from batchrun.quant.int4_layout import Int4Packed, can_mma_pack, mma_pack, pack_int4

L2_BYTES = 256 << 20  # read more than this per graph: the H200's L2 is 50 MB
MAX_REL_ERROR = 1e-2
# the sweep's candidates: (block_m, block_n, block_k, num_warps, num_stages) by M bucket
SWEEP = {
    "decode": [(16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (16, 256, 128, 4, 3),
               (16, 128, 64, 4, 6), (16, 128, 128, 8, 4), (32, 128, 128, 4, 4),
               (64, 128, 64, 4, 4)],
    "prefill": [(64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4),
                (128, 256, 64, 8, 3), (128, 64, 64, 4, 4), (64, 256, 64, 8, 3)],
}  # fmt: skip
SPLITS = (1, 2, 4, 8, 16)
# the CUDA-core GEMV's sweep at M = 1: (block_k, num_warps) x SPLITS and 32, 64 slices
FMA_SWEEP = [(128, 4), (128, 8), (64, 4)]
# the tensor-core GEMV's sweep: its K slices
MMA_SPLITS = (1, 2, 4, 8, 16, 32)
# the decode GEMV's sweep: (block_n, block_k, num_warps, num_stages) x SPLITS
GEMV_SWEEP = [(256, 64, 4, 2), (256, 64, 4, 3), (256, 64, 4, 4), (256, 128, 4, 3),
              (256, 32, 4, 4), (128, 64, 4, 3), (256, 64, 8, 3), (512, 64, 8, 3)]  # fmt: skip


def packed_bytes(w: Int4Packed) -> int:
    return sum(t.nbytes for t in (w.qweight, w.scales, w.zeros) if t is not None)


def graph_time_us(fn, weights: list, calls: int) -> float:
    """µs per call of fn(w) over a captured graph of `calls` calls cycling through `weights`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            fn(w)  # warm-up: compiles, allocates
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 5
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (reps * calls)


def copies(nbytes: int) -> int:
    return max(2, -(-L2_BYTES // nbytes) + 1)


def error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


def bench_shape(name: str, n: int, k: int, ms: list[int], sweep: str | None) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w = random_int4(n, k, 128, gen, symmetric=False)
    dense = w.dequantize(torch.bfloat16)
    packed = pack_int4(w)
    del w
    int4s = [packed] + [
        Int4Packed(packed.qweight.clone(), packed.scales.clone(), packed.zeros.clone(), 128)
        for _ in range(copies(packed_bytes(packed)) - 1)
    ]
    denses = [dense] + [dense.clone() for _ in range(copies(dense.nbytes) - 1)]
    # the weight in mma_pack's order, as an engine layer keeps it where int4_gemv_mma takes it
    mma_int4s = [mma_pack(p) for p in int4s] if can_mma_pack(packed) else []
    scratch = torch.empty((n, k), dtype=torch.bfloat16, device="cuda")  # int4_dequantize's
    dequant_us = graph_time_us(
        lambda p: int4_dequantize(p, torch.bfloat16, scratch), mma_int4s or int4s, 64
    )
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        ref = F.linear(x.float(), dense.float())
        calls = 64 if m <= 256 else 8
        bf16_us = graph_time_us(lambda d, x=x: F.linear(x, d), denses, calls)
        cfg, split = pick_config(m, n, k)
        candidates = [(cfg, split)]
        if sweep == "all":
            bucket = "decode" if m <= CONFIGS[2][0] else "prefill"
            for c in SWEEP[bucket]:
                splits = SPLITS if bucket == "decode" else (1,)
                candidates += [(Int4Config(*c), s) for s in splits]
        results = []
        for c, s in candidates:
            err = error(int4_matmul(x, packed, config=c, split_k=s), ref)
            if err > MAX_REL_ERROR:
                print(f"  {name} M={m} {c} split {s}: error {err:.2e}, skipped", flush=True)
                continue
            fn = lambda p, x=x, c=c, s=s: int4_matmul(x, p, config=c, split_k=s)  # noqa: E731
            us = graph_time_us(fn, int4s, calls)
            results.append((us, c, s))
        picked_us = results[0][0]
        mma_order_us = float("nan")
        if mma_int4s and error(int4_matmul(x, mma_int4s[0]), ref) <= MAX_REL_ERROR:
            fn = lambda p, x=x: int4_matmul(x, p)  # noqa: E731
            mma_order_us = graph_time_us(fn, mma_int4s, calls)
        # the weight dequantized into a scratch buffer, then cuBLAS (for M above the GEMVs')
        deq_linear_us = float("nan")
        deq = lambda p, x=x: F.linear(x, int4_dequantize(p, torch.bfloat16, scratch))  # noqa: E731
        if m > GEMV_MAX_M and error(deq((mma_int4s or int4s)[0]), ref) <= MAX_REL_ERROR:
            deq_linear_us = graph_time_us(deq, mma_int4s or int4s, calls)
        gemv_cols = {}
        if m <= GEMV_MAX_M:
            gemv_cols = bench_gemv(x, ref, dense, denses, int4s, calls, sweep, name == "gate_up")
        best_us, best_cfg, best_split = min(results, key=lambda r: r[0])
        flops = 2 * m * n * k
        row = dict(
            matrix=name, n=n, k=k, m=m, bf16_us=bf16_us, int4_us=picked_us,
            config=tuple(cfg), split_k=split, speedup=bf16_us / picked_us,
            int4_gbs=packed_bytes(packed) / picked_us / 1e3,
            bf16_gbs=dense.nbytes / bf16_us / 1e3,
            int4_tflops=flops / picked_us / 1e6, bf16_tflops=flops / bf16_us / 1e6,
            int4_mma_order_us=mma_order_us, dequant_us=dequant_us,
            dequant_linear_us=deq_linear_us,
        )  # fmt: skip
        if sweep == "all":
            row.update(best_us=best_us, best_config=tuple(best_cfg), best_split_k=best_split)
        row.update(gemv_cols)
        rows.append(row)
        line = (
            f"{name:8s} {n:6d}x{k:<6d} M={m:<5d} bf16 {bf16_us:9.1f} µs  int4 {picked_us:9.1f} µs"
            f"  x{row['speedup']:.2f}  int4 {row['int4_gbs']:7.0f} GB/s {row['int4_tflops']:6.1f}"
            f" TFLOP/s  bf16 {row['bf16_gbs']:7.0f} GB/s {row['bf16_tflops']:6.1f} TFLOP/s"
            f"  {tuple(cfg)} split {split}  mma order {mma_order_us:.1f} µs"
        )
        if m > GEMV_MAX_M:
            line += f"  dequant {dequant_us:.1f} + cuBLAS: {deq_linear_us:.1f} µs"
        if sweep == "all":
            line += f"  | best {best_us:.1f} µs {tuple(best_cfg)} split {best_split}"
        if gemv_cols:
            line += (
                f"\n{'':31s}int4_gemv {gemv_cols['int4_gemv_us']:7.1f} µs "
                f"{packed_bytes(packed) / gemv_cols['int4_gemv_us'] / 1e6:5.2f} TB/s  "
                f"bf16 gemv.py {gemv_cols['bf16_gemv_us']:7.1f} µs "
                f"{dense.nbytes / gemv_cols['bf16_gemv_us'] / 1e6:5.2f} TB/s  "
                f"cuBLAS {bf16_us:7.1f} µs {dense.nbytes / bf16_us / 1e6:5.2f} TB/s  "
                f"{gemv_cols['int4_gemv_config']}"
            )
            if "int4_gemv_fma_us" in gemv_cols:
                fma_us = gemv_cols["int4_gemv_fma_us"]
                line += (
                    f"\n{'':31s}int4_gemv fma {fma_us:7.1f} µs "
                    f"{packed_bytes(packed) / fma_us / 1e6:5.2f} TB/s  "
                    f"{gemv_cols['int4_gemv_fma_config']}"
                )
            if "int4_gemv_best_us" in gemv_cols:
                line += f"  | best {gemv_cols['int4_gemv_best_us']:.1f} µs "
                line += f"{gemv_cols['int4_gemv_best_config']}"
            if "int4_gemv_mma_us" in gemv_cols:
                mma_us = gemv_cols["int4_gemv_mma_us"]
                line += (
                    f"\n{'':31s}int4_gemv_mma {mma_us:7.1f} µs "
                    f"{packed_bytes(packed) / mma_us / 1e6:5.2f} TB/s"
                )
                if "int4_gemv_mma_swiglu_us" in gemv_cols:
                    line += f"  swiglu {gemv_cols['int4_gemv_mma_swiglu_us']:.1f} µs"
                line += (
                    f"\n{'':31s}int4_gemv_mma with PDL {gemv_cols['int4_gemv_mma_pdl_us']:.1f}"
                    f" µs, prefetching {gemv_cols['int4_gemv_mma_pdl_prefetch_us']:.1f} µs"
                )
                if "int4_gemv_mma_swiglu_pdl_us" in gemv_cols:
                    line += (
                        f"; swiglu {gemv_cols['int4_gemv_mma_swiglu_pdl_us']:.1f} µs, "
                        f"prefetching {gemv_cols['int4_gemv_mma_swiglu_pdl_prefetch_us']:.1f} µs"
                    )
            if "int4_gemv_swiglu_us" in gemv_cols:
                line += (
                    f"\n{'':31s}int4_gemv fma swiglu {gemv_cols['int4_gemv_swiglu_us']:7.1f} µs "
                    f"{gemv_cols['int4_gemv_swiglu_config']}  | best "
                    f"{gemv_cols['int4_gemv_swiglu_best_us']:.1f} µs "
                    f"{gemv_cols['int4_gemv_swiglu_best_config']}"
                )
        print(line, flush=True)
    return rows


def fma_sweep() -> list[Int4GemvConfig]:
    """The CUDA-core GEMV's candidates: FMA_SWEEP's tilings x SPLITS and 32, 64 slices."""
    return [
        Int4GemvConfig(256, bk, s, warps, 1, fma=True)
        for bk, warps in FMA_SWEEP
        for s in SPLITS + (32, 64)
    ]


def bench_mma(x, ref, int4s, calls: int, swiglu: bool, sweep: bool = False) -> dict:
    """kernels/int4_gemv_mma.py (the weights mma_pack-ed), µs a call, where it takes the
    matrix: plain, and with swiglu (a gate_up) also with the SwiGLU epilogue; with sweep also
    the best of MMA_SPLITS (each printed)."""
    if not can_mma_pack(int4s[0]):
        return {}
    mmas = [mma_pack(p) for p in int4s]
    if not mma_takes(mmas[0], x.shape[0]):
        return {}
    err = error(int4_gemv_mma(x, mmas[0]), ref)
    if err > MAX_REL_ERROR:
        print(f"  int4_gemv_mma M={x.shape[0]}: error {err:.2e}, skipped", flush=True)
        return {}
    cols = dict(int4_gemv_mma_us=graph_time_us(lambda w, x=x: int4_gemv_mma(x, w), mmas, calls))
    # the candidate that prefetches the next chunk's words, launched with PDL as the engine
    # launches both (the first chunk's words before the PDL wait)
    for prefetch in (False, True):
        fn = lambda w, x=x, p=prefetch: int4_gemv_mma(x, w, pdl=True, prefetch=p)  # noqa: E731
        cols[f"int4_gemv_mma_pdl{'_prefetch' if prefetch else ''}_us"] = graph_time_us(
            fn, mmas, calls
        )
    glu = swiglu and mma_takes(mmas[0], x.shape[0], swiglu=True)
    if glu:
        fn = lambda w, x=x: int4_gemv_mma(x, w, swiglu=True)  # noqa: E731
        cols.update(int4_gemv_mma_swiglu_us=graph_time_us(fn, mmas, calls))
        for prefetch in (False, True):
            fn = lambda w, x=x, p=prefetch: int4_gemv_mma(  # noqa: E731
                x, w, swiglu=True, pdl=True, prefetch=p
            )
            key = f"int4_gemv_mma_swiglu_pdl{'_prefetch' if prefetch else ''}_us"
            cols[key] = graph_time_us(fn, mmas, calls)
    if sweep:
        n, k = mmas[0].out_features, x.shape[1]
        for g in (False, True) if glu else (False,):
            times = {}
            for s in MMA_SPLITS:
                fn = lambda w, x=x, s=s, g=g: int4_gemv_mma(x, w, swiglu=g, split_k=s)  # noqa: E731
                times[s] = graph_time_us(fn, mmas, calls)
            line = " ".join(f"{s}: {us:.1f}" for s, us in times.items())
            print(f"  int4_gemv_mma {n}x{k} M={x.shape[0]} swiglu={g} split_k -> µs: {line}")
            best = min(times, key=times.get)
            key = "int4_gemv_mma_swiglu" if g else "int4_gemv_mma"
            cols.update({f"{key}_best_us": times[best], f"{key}_best_split": best})
    return cols


def bench_gemv(x, ref, dense, denses, int4s, calls: int, sweep: str | None,
               swiglu: bool = False) -> dict:  # fmt: skip
    """The decode columns at x's M: int4_gemv (its picked config; at M = 1 also the CUDA-core
    kernel's, pick_fma_config; with sweep the best of GEMV_SWEEP x SPLITS and, at M = 1,
    FMA_SWEEP x SPLITS) and bf16 kernels/gemv.py, µs a call. With swiglu (a gate_up) at M = 1
    also the CUDA-core kernel with the SwiGLU epilogue (the engine's gate_up), and with sweep
    its best of FMA_SWEEP x SPLITS."""
    m, k = x.shape
    n = dense.shape[0]
    picked = pick_dot_config(m, n, k)
    fma = pick_fma_config(n, k) if m == 1 else None
    candidates = [picked] + ([fma] if fma else [])
    if sweep in ("all", "gemv"):
        candidates += [
            Int4GemvConfig(bn, bk, s, warps, stages)
            for bn, bk, warps, stages in GEMV_SWEEP
            for s in SPLITS
        ]
    gemvs = sweep in ("all", "gemv", "fma")  # the int4_gemv sweeps
    if gemvs and m == 1:
        candidates += fma_sweep()
    times = {}
    for c in dict.fromkeys(candidates):
        err = error(int4_gemv(x, int4s[0], config=c), ref)
        if err > MAX_REL_ERROR:
            print(f"  int4_gemv M={m} {c}: error {err:.2e}, skipped", flush=True)
            continue
        fn = lambda p, x=x, c=c: int4_gemv(x, p, config=c, pdl=True)  # noqa: E731
        times[c] = graph_time_us(fn, int4s, calls)
    best = min(times, key=times.get)
    bf16_gemv_us = graph_time_us(lambda d, x=x: gemv(x, d, pdl=True), denses, calls)
    mma_cols = bench_mma(x, ref, int4s, calls, swiglu, sweep in ("all", "mma"))
    nan = float("nan")
    cols = dict(
        int4_gemv_us=times.get(picked, nan), int4_gemv_config=tuple(picked),
        bf16_gemv_us=bf16_gemv_us,
    )  # fmt: skip
    if fma:
        cols.update(int4_gemv_fma_us=times.get(fma, nan), int4_gemv_fma_config=tuple(fma))
    if gemvs:
        cols.update(int4_gemv_best_us=times[best], int4_gemv_best_config=tuple(best))
    cols.update(mma_cols)
    if fma and swiglu:
        glu = [pick_fma_config(n, k, swiglu=True)]
        if gemvs:
            glu += fma_sweep()
        glu_times = {}
        for c in dict.fromkeys(glu):
            fn = lambda p, x=x, c=c: int4_gemv(x, p, config=c, swiglu=True, pdl=True)  # noqa: E731
            glu_times[c] = graph_time_us(fn, int4s, calls)
        best_glu = min(glu_times, key=glu_times.get)
        cols.update(
            int4_gemv_swiglu_us=glu_times[glu[0]], int4_gemv_swiglu_config=tuple(glu[0]),
            int4_gemv_swiglu_best_us=glu_times[best_glu],
            int4_gemv_swiglu_best_config=tuple(best_glu),
        )  # fmt: skip
    return cols


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama-8b")
    p.add_argument("--m", default="1,4,16,64,256,2048,8192")
    p.add_argument(
        "--sweep", nargs="?", const="all", choices=("all", "gemv", "fma", "mma"),
        help="also time the configs of SWEEP, GEMV_SWEEP, FMA_SWEEP and MMA_SPLITS (gemv: the "
        "GEMVs' alone; fma: FMA_SWEEP's alone; mma: MMA_SPLITS alone)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench-out/int4_matmul"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_int4_matmul: needs CUDA")
        return 0
    prepare(torch.device("cuda"))
    ms = [int(v) for v in args.m.split(",")]
    report = {"environment": benchlib.environment("cuda"), "rows": []}
    for model in args.models.split(","):
        step = dict.fromkeys(("bf16_us", "int4_us", "int4_gemv_us", "int4_gemv_fma_us",
                              "int4_gemv_mma_us", "bf16_gemv_us"), 0.0)  # fmt: skip
        for name, n, k, count in benchlib.linear_shapes(model):
            if name == "lm_head":  # not quantized
                continue
            rows = bench_shape(name, n, k, ms, args.sweep)
            for row in rows:
                row["model"] = model
                if row["m"] == 1:
                    step["bf16_us"] += row["bf16_us"] * count
                    step["int4_us"] += row["int4_us"] * count
                    step["int4_gemv_us"] += row["int4_gemv_us"] * count
                    step["int4_gemv_fma_us"] += row["int4_gemv_fma_us"] * count
                    step["int4_gemv_mma_us"] += row.get("int4_gemv_mma_us", float("nan")) * count
                    step["bf16_gemv_us"] += row["bf16_gemv_us"] * count
            report["rows"] += rows
            torch.cuda.empty_cache()
        if 1 in ms:
            print(
                f"{model}: one decode step's matmuls at M = 1: bf16 {step['bf16_us'] / 1e3:.3f} "
                f"ms, int4 {step['int4_us'] / 1e3:.3f} ms, int4_gemv "
                f"{step['int4_gemv_us'] / 1e3:.3f} ms (fma {step['int4_gemv_fma_us'] / 1e3:.3f}"
                f" ms, mma {step['int4_gemv_mma_us'] / 1e3:.3f} ms), bf16 gemv.py "
                f"{step['bf16_gemv_us'] / 1e3:.3f} ms",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "int4_matmul.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
