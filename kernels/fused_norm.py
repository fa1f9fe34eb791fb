"""RMSNorm and residual-add + RMSNorm in one kernel each: one program per row, the row in registers.

Numerics are those of `batchrun.layers.norm.RMSNorm` (HF transformers):
    y = weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(dtype)
the sum of squares in fp32, the normalized row rounded to the activation dtype BEFORE the weight
multiply, and that product rounded once (as torch's bf16 `a * b`). The residual add of
`fused_add_rms_norm` is rounded to the activation dtype before the norm reads it, as torch's
`x + residual` would be.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchrun.kernels.pdl import pdl_launch_kwargs, pdl_wait


@triton.jit
def _normalize(s, W, offs, mask, n_cols, eps, OUT_DTYPE: tl.constexpr):
    """s: one row in fp32 (zeros past n_cols) -> weight * rmsnorm(s), rounded as in torch."""
    return _normalize_by(s, tl.load(W + offs, mask=mask, other=0.0), n_cols, eps, OUT_DTYPE)


@triton.jit
def _normalize_by(s, w, n_cols, eps, OUT_DTYPE: tl.constexpr):
    """`_normalize` with the weight's row w loaded."""
    mean_sq = tl.sum(s * s, 0) / n_cols
    normed = (s * tl.math.rsqrt(mean_sq + eps)).to(OUT_DTYPE)
    return (w.to(tl.float32) * normed.to(tl.float32)).to(OUT_DTYPE)


@triton.jit
def _rms_norm_kernel(
    X,
    W,
    Out,
    stride_x,
    stride_out,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # every input is an earlier kernel's output
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    y = _normalize(x, W, offs, mask, n_cols, eps, Out.dtype.element_ty)
    tl.store(Out + row * stride_out + offs, y, mask=mask)


@triton.jit
def _rms_norm_heads_kernel(
    X,  # [T, HQ + HK, D]: the q heads, then the k heads
    WQ,  # [D]
    WK,  # [D]
    stride_t,
    stride_h,
    num_q_heads,
    head_dim,
    eps,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # every input is an earlier kernel's output
    head = tl.program_id(1)
    ptrs = X + tl.program_id(0).to(tl.int64) * stride_t + head * stride_h + tl.arange(0, BLOCK)
    offs = tl.arange(0, BLOCK)
    mask = offs < head_dim
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    wq = tl.load(WQ + offs, mask=mask, other=0.0)
    wk = tl.load(WK + offs, mask=mask, other=0.0)
    y = _normalize_by(x, tl.where(head < num_q_heads, wq, wk), head_dim, eps, X.dtype.element_ty)
    tl.store(ptrs, y, mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(
    X,
    Residual,
    W,
    stride_x,
    stride_r,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # every input is an earlier kernel's output
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x_ptr = X + row * stride_x + offs
    r_ptr = Residual + row * stride_r + offs
    x = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr, mask=mask, other=0.0).to(tl.float32)
    # NOTE: round the sum to the activation dtype first: the norm must see the stored residual
    s = (x + r).to(Residual.dtype.element_ty)
    tl.store(r_ptr, s, mask=mask)
    y = _normalize(s.to(tl.float32), W, offs, mask, n_cols, eps, X.dtype.element_ty)
    tl.store(x_ptr, y, mask=mask)


def _launch_config(n_cols: int) -> tuple[int, int]:
    """(BLOCK, num_warps): the whole row in one block, about 16 elements per thread."""
    block = triton.next_power_of_2(n_cols)
    return block, min(max(block // 512, 1), 16)


def rms_norm(
    x: torch.Tensor,  # [T, N], unit stride along N
    weight: torch.Tensor,  # [N]
    eps: float,
    out: torch.Tensor | None = None,  # [T, N] of x's dtype; None: a new tensor
    *,
    pdl: bool = False,  # launched with programmatic dependent launch (kernels/pdl.py)
) -> torch.Tensor:
    num_rows, n_cols = x.shape
    assert x.stride(1) == 1 and weight.shape == (n_cols,) and weight.is_contiguous()
    assert weight.dtype == x.dtype, "torch would promote the output dtype; not supported here"
    if out is None:
        out = torch.empty((num_rows, n_cols), dtype=x.dtype, device=x.device)
    assert out.shape == x.shape and out.stride(1) == 1
    if num_rows == 0:
        return out
    block, num_warps = _launch_config(n_cols)
    launch = pdl_launch_kwargs(pdl, x)
    _rms_norm_kernel[(num_rows,)](
        x, weight, out, x.stride(0), out.stride(0), n_cols, eps, BLOCK=block,
        num_warps=num_warps, **launch,
    )  # fmt: skip
    return out


def rms_norm_heads(
    heads: torch.Tensor,  # [T, HQ + HK, D], unit stride along D; normalized in place
    q_weight: torch.Tensor,  # [D]: the q heads' norm
    k_weight: torch.Tensor,  # [D]: the k heads'
    num_q_heads: int,
    eps: float,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """Qwen3's q and k norms (per head, weight [D]) in one launch, in place on the qkv
    projection's q and k heads (a strided view: no copy), each head as `rms_norm` normalizes a
    row (the same program, so the same bits). Returns heads."""
    num_tokens, num_heads, head_dim = heads.shape
    assert heads.stride(2) == 1 and 0 < num_q_heads < num_heads
    for w in (q_weight, k_weight):
        assert w.shape == (head_dim,) and w.is_contiguous() and w.dtype == heads.dtype
    if num_tokens == 0:
        return heads
    block, num_warps = _launch_config(head_dim)
    launch = pdl_launch_kwargs(pdl, heads)
    _rms_norm_heads_kernel[(num_tokens, num_heads)](
        heads, q_weight, k_weight, heads.stride(0), heads.stride(1), num_q_heads, head_dim, eps,
        BLOCK=block, num_warps=num_warps, **launch,
    )  # fmt: skip
    return heads


def fused_add_rms_norm(
    x: torch.Tensor,  # [T, N], unit stride along N; overwritten with the normed output
    residual: torch.Tensor,  # [T, N], same dtype; overwritten with residual + x
    weight: torch.Tensor,  # [N]
    eps: float,
    *,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual += x; x = rms_norm(residual) * weight. Returns (x, residual)."""
    num_rows, n_cols = x.shape
    assert residual.shape == x.shape and residual.dtype == x.dtype == weight.dtype
    assert x.stride(1) == 1 and residual.stride(1) == 1
    assert weight.shape == (n_cols,) and weight.is_contiguous()
    if num_rows == 0:
        return x, residual
    block, num_warps = _launch_config(n_cols)
    launch = pdl_launch_kwargs(pdl, x)
    _fused_add_rms_norm_kernel[(num_rows,)](
        x,
        residual,
        weight,
        x.stride(0),
        residual.stride(0),
        n_cols,
        eps,
        BLOCK=block,
        num_warps=num_warps,
        **launch,
    )
    return x, residual
