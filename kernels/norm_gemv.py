"""Decode-sized (M <= 16) residual add + RMSNorm + matmul in one kernel, optionally with the
SwiGLU gate as its epilogue: a decoder layer's `norm -> qkv` and `norm -> gate_up -> silu * up`.

At batch 1 a decode step is latency-bound: every kernel costs its launch, ramp-up and drain
(~2 µs in a CUDA graph) whatever it computes, and a layer ran 11 of them (llama-1b W3: 1,073 µs
of kernels per step, 177 µs of them not GEMVs). This folds the two norm kernels and the SiLU
kernel of each layer into the GEMVs that follow them.

    y, residual = norm_gemv(x, residual, norm_w, eps, w)                # rmsnorm(x + r) @ w.T
    act, residual = norm_gemv(x, residual, norm_w, eps, w_gate_up, swiglu=True)
                                      # silu(n @ w_gate.T) * (n @ w_up.T), w = [gate rows | up rows]

One pass: each program streams its weight tile as kernels/gemv.py does and, from the same
input tiles (x + residual: a few KB from L2 at decode sizes), the rows' sums of squares; the
rows' 1 / rms scales the fp32 sums after the dot (rmsnorm(s) * g @ w.T = (s * g @ w.T) / rms(s)).
A first pass for the norm cost more than the separate norm kernel it replaced (H200, llama-1b
W3: 1.31 against 1.17 ms per token). x + residual goes to a new tensor (programs still read the
old one), each K tile by one program, before the matmul loop. Numerics: the sum rounded to the
activation dtype as torch's `x + residual` (bit-exact residual stream); the product s * g
rounded to the dtype for the tensor cores, where the unfused path rounds the normalized row
first: a different rounding, not bit-identical, and so is the fp32 accumulation order against
cuBLAS. The SwiGLU rounds gate and up to the dtype first, as the [T, 2I] GEMV output would be. No
split-K: every program needs whole rows for their 1 / rms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchrun.kernels.gemv import MAX_M, GemvConfig, pick_config


@triton.jit
def _norm_gemv_kernel(
    X,
    R,
    G,
    W,
    Y,
    RES,
    M,
    N,
    K,
    up_offset,
    stride_xm,
    stride_rm,
    stride_resm,
    stride_wn,
    stride_ym,
    eps,
    HAS_RES: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    dtype = X.dtype.element_ty
    offs_m = tl.arange(0, 16)
    in_m = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = offs_n < N
    w_rows = offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    # NOTE: the rows' sums of squares come from the tensor cores (the diagonal of s @ s.T, exact
    # products of the rounded sum, fp32 sums)
    sq = tl.zeros([16, 16], dtype=tl.float32)
    if HAS_RES:
        # x + residual to its new tensor, each K tile by one program (round robin), before the
        # matmul loop: a store inside that loop stopped its loads being prefetched (they might
        # alias it), and the kernel ran 4x slower than the plain GEMV
        for k0 in range(pid_n * BLOCK_K, K, tl.num_programs(0) * BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask = in_m[:, None] & (offs_k < K)[None, :]
            s = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
            r = tl.load(R + offs_m[:, None] * stride_rm + offs_k[None, :], mask=mask, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(dtype)
            tl.store(RES + offs_m[:, None] * stride_resm + offs_k[None, :], s, mask=mask)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < K
        mask = in_m[:, None] & in_k[None, :]
        s = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(R + offs_m[:, None] * stride_rm + offs_k[None, :], mask=mask, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(dtype)
        sq = tl.dot(s, tl.trans(s), sq)
        g = tl.load(G + offs_k, mask=in_k, other=0.0).to(tl.float32)
        # [16, BLOCK_K]; the row's 1 / rms comes after the dot
        a = (s.to(tl.float32) * g[None, :]).to(dtype)
        w_mask = in_n[:, None] & in_k[None, :]
        w = tl.load(W + w_rows + offs_k[None, :], mask=w_mask, other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
        if SWIGLU:
            up_rows = W + up_offset.to(tl.int64) * stride_wn + w_rows
            w_up = tl.load(up_rows + offs_k[None, :], mask=w_mask, other=0.0)
            acc_up = tl.dot(a, tl.trans(w_up), acc_up)
    sum_sq = tl.sum(tl.where(offs_m[:, None] == offs_m[None, :], sq, 0.0), 1)
    rstd = tl.math.rsqrt(sum_sq / K + eps)[:, None]
    if SWIGLU:
        gate = (acc * rstd).to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        out = silu.to(tl.float32) * (acc_up * rstd).to(dtype).to(tl.float32)
    else:
        out = acc * rstd
    y_ptr = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptr, out.to(Y.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


def pick_fused_config(m: int, n: int, k: int, swiglu: bool) -> GemvConfig:
    """gemv's config for the same output, without split-K (each program needs whole rows for
    their 1 / rms); with SwiGLU each program reads two weight tiles (gate and up), so half the
    columns per program."""
    cfg = pick_config(m, 2 * n if swiglu else n, k)._replace(split_k=1)
    return cfg._replace(block_n=max(16, cfg.block_n // 2)) if swiglu else cfg


def norm_gemv(
    x: torch.Tensor,  # [M, K], M <= 16, unit stride along K
    residual: torch.Tensor | None,  # [M, K] or None (the first layer: x is the residual)
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    w: torch.Tensor,  # [N, K] (swiglu: [2I, K], gate rows then up rows)
    swiglu: bool = False,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, x + residual): y = rmsnorm(x + residual) * norm_weight @ w.T, [M, N]; with swiglu
    silu(gate) * up, [M, I]. Neither input is written."""
    m, k = x.shape
    n_rows, k_w = w.shape
    assert k == k_w and m <= MAX_M and x.stride(1) == 1 and w.stride(1) == 1
    assert x.dtype == w.dtype == norm_weight.dtype and x.dtype in (torch.float16, torch.bfloat16)
    assert norm_weight.shape == (k,) and norm_weight.is_contiguous()
    assert not swiglu or n_rows % 2 == 0
    n = n_rows // 2 if swiglu else n_rows
    has_res = residual is not None
    if has_res:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert residual.stride(1) == 1
        res_out = torch.empty((m, k), dtype=x.dtype, device=x.device)
    else:
        res_out = x
    cfg = config or pick_fused_config(m, n, k, swiglu)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y, (x + residual if has_res else x)
    r = residual if has_res else x
    _norm_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, r, norm_weight, w, y, res_out, m, n, k, n,
        x.stride(0), r.stride(0), res_out.stride(0), w.stride(0), y.stride(0), eps,
        HAS_RES=has_res, SWIGLU=swiglu, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y, res_out
