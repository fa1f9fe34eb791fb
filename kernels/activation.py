"""Gated MLP activations in one kernel, grid (T, cdiv(I, BLOCK)): SwiGLU's
silu(x[:, :I]) * x[:, I:] (silu_and_mul) and GeGLU's gelu_tanh(x[:, :I]) * x[:, I:]
(gelu_tanh_and_mul: Gemma's gelu_pytorch_tanh gate).

Numerics are those of torch's `F.silu(gate) * up` / `F.gelu(gate, approximate="tanh") * up` in
the activation dtype: the activation computed in fp32 and rounded once to the dtype (as torch's
CUDA kernels do with their fp32 opmath), then the product computed in fp32 and rounded once.
Triton's exp and division are the fast hardware versions, and GELU's tanh is computed from exp
(Triton has no tanh of its own), so the activation may differ from torch's by a few fp32 ulp,
more in GELU's negative tail, where torch's 1 + tanh(u) cancels: after rounding, an occasional
1-ulp difference in bf16/fp16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchrun.kernels.pdl import pdl_launch_kwargs, pdl_wait

DEFAULT_BLOCK = 1024
# the activations of the gate (the kernel's ACT)
SILU, GELU_TANH = 0, 1


@triton.jit
def _silu_and_mul_kernel(
    X,
    Out,
    stride_x,
    stride_out,
    inter_size,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    ACT: tl.constexpr,  # SILU or GELU_TANH
):
    pdl_wait(PDL)  # every input is an earlier kernel's output
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter_size
    x_ptr = X + t * stride_x + offs
    gate = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + inter_size, mask=mask, other=0.0).to(tl.float32)
    dtype = Out.dtype.element_ty
    if ACT == 0:
        act = gate / (1.0 + tl.exp(-gate))
    else:  # gelu tanh: 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3), written
        # x / (1 + exp(-2u)), which is the same and cancels nowhere (1 + tanh(u) does for u < 0)
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * inner))
    act = act.to(dtype)
    tl.store(Out + t * stride_out + offs, (act.to(tl.float32) * up).to(dtype), mask=mask)


def silu_and_mul(
    x: torch.Tensor,  # [T, 2 * I], unit stride along the last dim
    out: torch.Tensor | None = None,  # [T, I] of x's dtype; None: a new tensor
    *,
    pdl: bool = False,  # launched with programmatic dependent launch (kernels/pdl.py)
) -> torch.Tensor:
    return _act_and_mul(x, out, pdl, SILU)


def gelu_tanh_and_mul(
    x: torch.Tensor,  # [T, 2 * I], unit stride along the last dim
    out: torch.Tensor | None = None,  # [T, I] of x's dtype; None: a new tensor
    *,
    pdl: bool = False,  # launched with programmatic dependent launch (kernels/pdl.py)
) -> torch.Tensor:
    return _act_and_mul(x, out, pdl, GELU_TANH)


def _act_and_mul(x: torch.Tensor, out: torch.Tensor | None, pdl: bool, act: int) -> torch.Tensor:
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
        x, out, x.stride(0), out.stride(0), inter_size, BLOCK=block, ACT=act, num_warps=4,
        **launch,
    )  # fmt: skip
    return out
