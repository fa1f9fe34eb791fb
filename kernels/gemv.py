"""Skinny matmul for decode: y[M, N] = x[M, K] @ w[N, K]^T for M <= 16 (F.linear without bias).

At batch 1 a decode step is GEMVs: on the H200, llama-1b's 64 cuBLAS GEMVs per step took 773 µs
for 1.95 GB of weights (2.5 TB/s, 59 % of the copy ceiling), llama-8b's 4.0 TB/s (94 %). The
small matrices of a 1b model (2048 x 2048, 2048 x 512) leave cuBLAS few blocks in flight. This
kernel streams w in [BLOCK_N, BLOCK_K] tiles: a program owns BLOCK_N output columns and, with
SPLIT_K > 1, one K-slice of them, so small N still fills the GPU; each slice writes its fp32
partial sums to its own plane of a [SPLIT_K, M, N] buffer, summed and cast after (no atomics:
the result must not depend on the order the slices finish in, or greedy tokens could differ
from run to run).

    y = gemv(x, w)                          # a config from pick_config(M, N, K)
    y = gemv(x, w, config=GemvConfig(...))  # scripts/bench_gemv.py sweeps these on the device

Accumulation is fp32 (tl.dot with x padded to 16 rows: the tensor cores do the padding rows for
free, and w is read once whatever M is). Grid (cdiv(N, BLOCK_N), SPLIT_K).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from batchrun.kernels.pdl import pdl_launch_kwargs, pdl_wait

MAX_M = 16


class GemvConfig(NamedTuple):
    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _w_tile(w_rows, in_n, k0, k_end, BLOCK_K: tl.constexpr):
    """w [BLOCK_N, BLOCK_K] at K offset k0 (zeros past N and k_end)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_rows + offs_k[None, :], mask=in_n & (offs_k < k_end)[None, :], other=0.0)


@triton.jit
def _x_tile(X, offs_m, M, stride_xm, k0, k_end, BLOCK_K: tl.constexpr):
    """x [16, BLOCK_K] at K offset k0 (zeros past M and k_end: the tensor cores' padding)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_m[:, None] < M) & (offs_k < k_end)[None, :]
    return tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)


@triton.jit
def _mma(acc, x, w, IEEE: tl.constexpr):
    if IEEE:  # fp32 inputs: full precision, not tf32
        return tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


@triton.jit
def _gemv_kernel(
    X,
    W,
    Y,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_ys,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    in_n = offs_n[:, None] < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # NOTE: the first tile is peeled off the loop so that its w load comes before the PDL wait:
    # weights are no earlier kernel's output, so with PDL that load overlaps the kernel before
    # (kernels/pdl.py); x is read after the wait
    w = _w_tile(w_rows, in_n, k_start, k_end, BLOCK_K)
    pdl_wait(PDL)
    x = _x_tile(X, offs_m, M, stride_xm, k_start, k_end, BLOCK_K)
    acc = _mma(tl.zeros([16, BLOCK_N], dtype=tl.float32), x, w, IEEE)
    for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
        w = _w_tile(w_rows, in_n, k0, k_end, BLOCK_K)
        x = _x_tile(X, offs_m, M, stride_xm, k0, k_end, BLOCK_K)
        acc = _mma(acc, x, w, IEEE)
    out = Y + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out, acc.to(Y.dtype.element_ty), mask=mask)


def pick_config(m: int, n: int, k: int) -> GemvConfig:
    """The best configs of scripts/bench_gemv.py on the H200 (M = 1, the matrices of llama-1b
    and llama-8b; docs/benchmarks.md), as a rule: 64 columns per program for wide matrices,
    512-wide K tiles for narrow ones, and 16 columns where 32 leave the GPU under-filled on a
    long K (llama-1b's down_proj, 2048 x 8192: 13.3 µs with PDL, against 16.2 in 4 K slices,
    whose fp32 planes take two more kernels to sum). No split-K."""
    block_n = 64 if n >= 6144 else 32
    if triton.cdiv(n, block_n) < 100 and k >= 8192:
        block_n = 16
    block_k = 256 if n >= 8192 else 512
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=1)


def gemv(
    x: torch.Tensor,  # [M, K], M <= 16, unit stride along K
    w: torch.Tensor,  # [N, K], unit stride along K (an nn.Linear weight)
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x @ w.T: [M, N] in x's dtype."""
    m, k = x.shape
    n, k_w = w.shape
    assert k == k_w and m <= MAX_M and x.stride(1) == 1 and w.stride(1) == 1
    assert x.dtype == w.dtype
    cfg = config or pick_config(m, n, k)
    if x.dtype == torch.float32:  # 4-byte tiles: fit the shared memory (227 KB on the H200)
        cfg = cfg._replace(block_k=min(cfg.block_k, 128), num_stages=min(cfg.num_stages, 2))
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(k, k_per_split)
    # one slice: the result in x's dtype straight away; else fp32 planes, summed below
    dtype = x.dtype if split_k == 1 else torch.float32
    y = torch.empty((split_k, m, n), dtype=dtype, device=x.device)
    if m == 0 or n == 0:
        return y.sum(0).to(x.dtype)
    grid = (triton.cdiv(n, cfg.block_n), split_k)
    pdl = pdl_launch_kwargs(x)
    _gemv_kernel[grid](
        x, w, y, m, n, k, k_per_split, x.stride(0), w.stride(0), y.stride(1), y.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IEEE=x.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )  # fmt: skip
    return y[0] if split_k == 1 else y.sum(0).to(x.dtype)
