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
    mean_sq = tl.sum(s * s, 0) / n_cols
    normed = (s * tl.math.rsqrt(mean_sq + eps)).to(OUT_DTYPE)
    w = tl.load(W + offs, mask=mask, other=0.0)
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
