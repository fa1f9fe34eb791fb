"""SwiGLU gate: silu(x[:, :I]) * x[:, I:] in one kernel, grid (T, cdiv(I, BLOCK)).

Numerics are those of torch's `F.silu(gate) * up` in the activation dtype: silu computed in fp32
and rounded once to the dtype (as torch's CUDA kernel does with its fp32 opmath), then the product
computed in fp32 and rounded once. Triton's exp and division are the fast hardware versions, so
silu may differ from torch's by a few fp32 ulp: after rounding, an occasional 1-ulp difference in
bf16/fp16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchrun.kernels.pdl import pdl_launch_kwargs, pdl_wait

DEFAULT_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    X,
    Out,
    stride_x,
    stride_out,
    inter_size,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # every input is an earlier kernel's output
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter_size
    x_ptr = X + t * stride_x + offs
    gate = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + inter_size, mask=mask, other=0.0).to(tl.float32)
    dtype = Out.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    tl.store(Out + t * stride_out + offs, (silu.to(tl.float32) * up).to(dtype), mask=mask)


def silu_and_mul(
    x: torch.Tensor,  # [T, 2 * I], unit stride along the last dim
    out: torch.Tensor | None = None,  # [T, I] of x's dtype; None: a new tensor
    *,
    pdl: bool = False,  # launched with programmatic dependent launch (kernels/pdl.py)
) -> torch.Tensor:
    num_tokens, two_inter = x.shape
    assert two_inter % 2 == 0 and x.stride(1) == 1
    inter_size = two_inter // 2
    if out is None:
        out = torch.empty((num_tokens, inter_size), dtype=x.dtype, device=x.device)
    assert out.shape == (num_tokens, inter_size) and out.dtype == x.dtype and out.stride(1) == 1
    if num_tokens == 0:
        return out
    block = min(DEFAULT_BLOCK, triton.next_power_of_2(inter_size))
    grid = (num_tokens, triton.cdiv(inter_size, block))
    launch = pdl_launch_kwargs(pdl, x)
    _silu_and_mul_kernel[grid](
        x, out, x.stride(0), out.stride(0), inter_size, BLOCK=block, num_warps=4,
        **launch,
    )  # fmt: skip
    return out
