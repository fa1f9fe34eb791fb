"""FP8 matmuls on the GPU, per llama-8b projection and M (rows of x), in one run:

    quant        activation quantization: act_quant.py's torch ops against kernels/fp8_quant.py
                 (per token; per token in groups of 128: a torch chain written here)
    bf16         F.linear on the bf16 weight (cuBLAS): the baseline
    scaled_mm    per-channel FP8: quantize x per token + torch._scaled_mm (row-wise scales);
                 "fast": the matmul with use_fast_accum (KernelPlan.fp8_fast_accum, the
                 engine's default), the other figures with the sums promoted to fp32
    block        block FP8: quantize x per token and group + cuBLASLt's block-scaled matmul
                 (torch's F.scaled_mm, CUDA 12.9+ on sm_90), and FlashInfer's where installed

    python scripts/bench_fp8_matmul.py                      # M = 1, 16, 64, 256, 2048, 8192

What decides: `quant triton` below `quant torch` at every M keeps the Triton quantization on
(QuantMatmul's scaled_mm path on CUDA); `block` against `scaled_mm` and `bf16` per M says what
block FP8 costs against per-channel FP8 and what it gains over bf16.

Each time is µs per call from a CUDA graph of many calls (no launch overhead, as in the engine's
graphs), timed with CUDA events; at M <= 256 the calls cycle through enough copies of the weight
to exceed the L2 cache, so each reads its weight from HBM. Every FP8 path is checked against the
dequantized fp32 reference first (relative error <= 1e-2). Writes the figures as JSON under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import benchlib
import torch
import torch.nn.functional as F

from batchrun.quant.act_quant import quant_per_token
from batchrun.quant.quantize import quantize_fp8

L2_BYTES = 256 << 20  # the H200's L2 is 50 MB
MATRICES = ("qkv", "o", "gate_up", "down")
FP8 = torch.float8_e4m3fn


def graph_time_us(fn, operands: list, calls: int) -> float:
    """µs per call of fn(operand) over a captured graph of `calls` calls cycling `operands`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for op in operands[:2]:
            fn(op)  # warm-up: compiles, allocates
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(operands[i % len(operands)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 3
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    del graph
    return 1e3 * start.elapsed_time(end) / (reps * calls)


def torch_group_quant(x: torch.Tensor, group: int = 128):
    """Per token and group with torch ops: what the block path would run without the kernel."""
    xg = x.float().view(x.shape[0], -1, group)
    scale = (xg.abs().amax(dim=-1, keepdim=True) * (1.0 / 448.0)).clamp(min=1e-12)
    q = (xg / scale).clamp(-448.0, 448.0).to(FP8)
    return q.view(x.shape), scale.view(x.shape[0], -1)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def cublaslt_block(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """The block-FP8 matmul of torch's scaled_mm (cuBLASLt, CUDA 12.9+ on sm_90): x quantized
    per token and group of 128 (column-major scales), the weight's 128 x 128 block scales; M
    padded to a multiple of 4, as the library needs (K / 128 of the llama shapes is)."""
    from batchrun.kernels import fp8_quant

    m = x.shape[0]
    xp = F.pad(x, (0, 0, 0, -m % 4)) if m % 4 else x
    xq, sx = fp8_quant.quant_per_token_group(xp)
    st = F.ScalingType
    y = F.scaled_mm(
        xq, w.t(), sx, st.BlockWise1x128, sw.t(), st.BlockWise128x128, output_dtype=x.dtype
    )
    return y[:m]


def flashinfer_block(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """FlashInfer's sm_90 block-scale GEMM (it quantizes x per 128 columns itself)."""
    from flashinfer.gemm import fp8_blockscale_gemm_sm90

    return fp8_blockscale_gemm_sm90(x, w, None, sw)


def bench(n: int, k: int, m: int) -> dict:
    from batchrun.kernels import fp8_quant

    torch.manual_seed(0)
    memory_bound = m <= 256
    copies = max(2, -(-L2_BYTES // (n * k))) if memory_bound else 2
    copies = min(copies, 32)
    calls = 64 if memory_bound else 8
    w = torch.randn(n, k, device="cuda") * 0.02
    channel, block = quantize_fp8(w, "channel"), quantize_fp8(w, "block", (128, 128))
    bf16 = [w.to(torch.bfloat16) for _ in range(copies)]
    ch = [(channel.weight.clone(), channel.scale.reshape(1, -1).clone()) for _ in range(copies)]
    bl = [(block.weight.clone(), block.scale.clone()) for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xs = [x]
    r = {}

    # correctness, against the dequantized fp32 weights and the quantized activations
    xq_t, sx_t = fp8_quant.quant_per_token(x)

    def scaled_mm(op, xq=xq_t, sx=sx_t, fast=False):
        return torch._scaled_mm(
            xq, op[0].t(), scale_a=sx, scale_b=op[1], out_dtype=torch.bfloat16,
            use_fast_accum=fast,
        )  # fmt: skip

    want = (xq_t.float() * sx_t) @ channel.dequantize().T
    r["scaled_mm_error"] = rel_error(scaled_mm(ch[0]), want)
    r["fast_error"] = rel_error(scaled_mm(ch[0], fast=True), want)
    xq, sxg = fp8_quant.quant_per_token_group(x)
    want = (xq.float() * sxg.repeat_interleave(128, 1)) @ block.dequantize().T

    r["quant_torch_us"] = graph_time_us(lambda a: quant_per_token(a), xs, calls)
    r["quant_triton_us"] = graph_time_us(lambda a: fp8_quant.quant_per_token(a), xs, calls)
    r["group_quant_torch_us"] = graph_time_us(lambda a: torch_group_quant(a), xs, calls)
    r["group_quant_triton_us"] = graph_time_us(fp8_quant.quant_per_token_group, xs, calls)
    r["bf16_us"] = graph_time_us(lambda wb: F.linear(x, wb), bf16, calls)
    r["scaled_mm_matmul_us"] = graph_time_us(scaled_mm, ch, calls)
    r["fast_matmul_us"] = graph_time_us(lambda op: scaled_mm(op, fast=True), ch, calls)
    r["scaled_mm_us"] = graph_time_us(
        lambda op: scaled_mm(op, *fp8_quant.quant_per_token(x)), ch, calls
    )
    for name, fn in (("cublaslt", cublaslt_block), ("flashinfer", flashinfer_block)):
        try:  # another library's block-FP8 matmul, where this torch / install has it
            r[f"{name}_error"] = rel_error(fn(x, *bl[0]), want)
            r[f"{name}_us"] = graph_time_us(lambda op, fn=fn: fn(x, *op), bl, calls)
        except Exception as e:  # not supported here: reported, not fatal
            r[f"{name}_us"] = f"{type(e).__name__}: {str(e)[:120]}"
    del bf16, ch, bl
    torch.cuda.empty_cache()
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama-8b", choices=["llama-8b", "llama-1b"])
    p.add_argument("--m", default="1,16,64,256,2048,8192", help="rows of x, comma-separated")
    p.add_argument("--matrices", default=",".join(MATRICES), help="which of the model's")
    p.add_argument("--out", type=Path, default=benchlib.OUT_DIR)
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("bench_fp8_matmul: needs an sm_89+ GPU (FP8 tensor cores)")
        return 0
    report = {"device": torch.cuda.get_device_name(), "model": args.model, "results": []}
    print(
        "| matrix | N x K | M | quant torch / triton µs | group quant torch / triton µs "
        "| bf16 µs | scaled_mm µs (matmul; fast) | errors |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, n, k, _ in benchlib.linear_shapes(args.model):
        if name not in args.matrices.split(","):
            continue
        for m in (int(v) for v in args.m.split(",")):
            r = bench(n, k, m)
            r.update(matrix=name, n=n, k=k, m=m)
            report["results"].append(r)
            print(
                f"| {name} | {n} x {k} | {m} | {r['quant_torch_us']:.1f} / "
                f"{r['quant_triton_us']:.1f} | {r['group_quant_torch_us']:.1f} / "
                f"{r['group_quant_triton_us']:.1f} | {r['bf16_us']:.1f} | "
                f"{r['scaled_mm_us']:.1f} ({r['scaled_mm_matmul_us']:.1f}; "
                f"{r['fast_matmul_us']:.1f}) | "
                f"{r['scaled_mm_error']:.1e}, fast {r['fast_error']:.1e} |",
                flush=True,
            )
            for lib in ("cublaslt", "flashinfer"):
                us, err = r[f"{lib}_us"], r.get(f"{lib}_error")
                got = f"{us:.1f} µs, error {err:.1e}" if isinstance(us, float) else us
                print(f"    block on {lib}: {got}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_fp8_matmul.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
