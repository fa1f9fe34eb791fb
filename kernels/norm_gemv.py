"""Decode-sized (M <= 16) residual add + RMSNorm + matmul in one kernel, optionally with the
SwiGLU gate as its epilogue: a decoder layer's `norm -> qkv` and `norm -> gate_up -> silu * up`.

At batch 1 a decode step is latency-bound: every kernel costs its launch, ramp-up and drain
(~2 µs in a CUDA graph) whatever it computes, and a layer ran 11 of them (llama-1b W3: 1,073 µs
of kernels per step, 177 µs of them not GEMVs). This folds the two norm kernels and the SiLU
kernel of each layer into the GEMVs that follow them.

    y, residual = norm_gemv(x, residual, norm_w, eps, w)                # rmsnorm(x + r) @ w.T
    act, residual = norm_gemv(x, residual, norm_w, eps, w_gate_up, swiglu=True)
                                      # silu(n @ w_gate.T) * (n @ w_up.T), w = [gate rows | up rows]

Each program first reads the whole [M, K] input (x + residual: a few KB from L2 at decode
sizes) for the rows' sums of squares, then streams its weight tile as kernels/gemv.py does,
normalizing the input tile on the fly. Program (0, 0) stores x + residual to a new tensor
(others still read the old one). Numerics follow the unfused path (kernels/fused_norm.py and
kernels/activation.py): the sum rounded to the activation dtype before the norm, the normalized
row rounded before the weight multiply and the product rounded once; the GEMV accumulates in
fp32 (in its own order: not bit-identical to cuBLAS); the SwiGLU rounds gate and up to the dtype
first, as the [T, 2I] GEMV output would be. SwiGLU needs whole sums: no split-K with it.
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
    k_per_split,
    up_offset,
    stride_xm,
    stride_rm,
    stride_resm,
    stride_wn,
    stride_ym,
    stride_ys,
    eps,
    HAS_RES: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    dtype = X.dtype.element_ty
    offs_m = tl.arange(0, 16)
    in_m = offs_m < M
    store_res = (pid_n == 0) & (pid_k == 0)

    # pass 1: each row's sum of squares over all of K
    sum_sq = tl.zeros([16], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = in_m[:, None] & (offs_k < K)[None, :]
        s = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(R + offs_m[:, None] * stride_rm + offs_k[None, :], mask=mask, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(dtype)
            if store_res:
                tl.store(RES + offs_m[:, None] * stride_resm + offs_k[None, :], s, mask=mask)
        s = s.to(tl.float32)
        sum_sq += tl.sum(s * s, 1)
    rstd = tl.math.rsqrt(sum_sq / K + eps)

    # pass 2: this program's columns over its K slice
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    w_rows = offs_n[:, None].to(tl.int64) * stride_wn
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < k_end
        mask = in_m[:, None] & in_k[None, :]
        s = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(R + offs_m[:, None] * stride_rm + offs_k[None, :], mask=mask, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(dtype)
        normed = (s.to(tl.float32) * rstd[:, None]).to(dtype)
        g = tl.load(G + offs_k, mask=in_k, other=0.0)
        a = (g.to(tl.float32)[None, :] * normed.to(tl.float32)).to(dtype)  # [16, BLOCK_K]
        w_mask = in_n[:, None] & in_k[None, :]
        w = tl.load(W + w_rows + offs_k[None, :], mask=w_mask, other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
        if SWIGLU:
            up_rows = W + up_offset.to(tl.int64) * stride_wn + w_rows
            w_up = tl.load(up_rows + offs_k[None, :], mask=w_mask, other=0.0)
            acc_up = tl.dot(a, tl.trans(w_up), acc_up)
    if SWIGLU:
        gate = acc.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        out = silu.to(tl.float32) * acc_up.to(dtype).to(tl.float32)
    else:
        out = acc
    y_ptr = Y + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptr, out.to(Y.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


def pick_fused_config(m: int, n: int, k: int, swiglu: bool) -> GemvConfig:
    """gemv's config for the same output; with SwiGLU each program reads two weight tiles (gate
    and up), so half the columns per program, and no split-K."""
    cfg = pick_config(m, 2 * n if swiglu else n, k)
    if swiglu:
        return cfg._replace(block_n=max(16, cfg.block_n // 2), split_k=1)
    return cfg


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
    assert not (swiglu and cfg.split_k > 1), "SwiGLU needs whole sums: split_k must be 1"
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(k, k_per_split)
    dtype = x.dtype if split_k == 1 else torch.float32
    y = torch.empty((split_k, m, n), dtype=dtype, device=x.device)
    if m == 0 or n == 0:
        return y.sum(0).to(x.dtype), (x + residual if has_res else x)
    r = residual if has_res else x
    grid = (triton.cdiv(n, cfg.block_n), split_k)
    _norm_gemv_kernel[grid](
        x, r, norm_weight, w, y, res_out, m, n, k, k_per_split, n,
        x.stride(0), r.stride(0), res_out.stride(0), w.stride(0), y.stride(1), y.stride(0), eps,
        HAS_RES=has_res, SWIGLU=swiglu, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return (y[0] if split_k == 1 else y.sum(0).to(x.dtype)), res_out
