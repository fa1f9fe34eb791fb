"""Neox-style (rotate-half) rotary embedding of q and k in place, in one launch: one program per
token covers all of its q and k heads.

    x = [x1 | x2] (halves of D), c = cos_cache[pos].to(dtype), s = sin_cache[pos].to(dtype)
    out = [x1 * c1 - x2 * s1 | x2 * c2 + x1 * s2]

Numerics are those of `batchrun.models.layers._apply_rotary` (HF transformers): every product and
the sum are rounded to the activation dtype, as torch's unfused bf16/fp16 elementwise ops round
each result. Products of two bf16/fp16 values are exact in fp32, so the bf16/fp16 results equal the
torch path bit for bit; in fp32 the compiler may contract to an FMA (within an ulp).

q and k may be strided views (slices of the fused qkv projection): only the last dim must be
contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchrun.kernels.pdl import pdl_launch_kwargs, pdl_wait


@triton.jit
def _rotate_heads(
    X,
    stride_h,
    num_heads,
    c1,
    s1,
    c2,
    s2,
    offs_d,
    mask_d,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Rotate heads [0, num_heads) of one token; X points at head 0, dim 0. c/s: [1, BLOCK_HALF]."""
    dtype = X.dtype.element_ty
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < num_heads)[:, None] & mask_d[None, :]
    ptr1 = X + offs_h[:, None] * stride_h + offs_d[None, :]  # [BLOCK_H, HALF]
    ptr2 = ptr1 + HALF
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr2, mask=mask, other=0.0).to(tl.float32)
    # NOTE: round each product before the sum, as torch's `x * cos + rotated * sin` does
    y1 = (x1 * c1).to(dtype).to(tl.float32) - (x2 * s1).to(dtype).to(tl.float32)
    y2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    tl.store(ptr1, y1.to(dtype), mask=mask)
    tl.store(ptr2, y2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    Q,
    K,
    Positions,
    Cos,
    Sin,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # every input is an earlier kernel's output
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    dtype = Q.dtype.element_ty
    # cos/sin rounded to the activation dtype first, as `cos.to(x.dtype)` in the torch path
    cos_ptr = Cos + pos * stride_cos + offs_d
    sin_ptr = Sin + pos * stride_sin + offs_d
    c1 = tl.load(cos_ptr, mask=mask_d, other=0.0).to(dtype).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + HALF, mask=mask_d, other=0.0).to(dtype).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr, mask=mask_d, other=0.0).to(dtype).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + HALF, mask=mask_d, other=0.0).to(dtype).to(tl.float32)[None, :]
    q_ptr = Q + t * stride_qt
    _rotate_heads(q_ptr, stride_qh, num_q_heads, c1, s1, c2, s2, offs_d, mask_d, HALF, BLOCK_HQ)
    k_ptr = K + t * stride_kt
    _rotate_heads(k_ptr, stride_kh, num_k_heads, c1, s1, c2, s2, offs_d, mask_d, HALF, BLOCK_HK)


def apply_rotary_(
    q: torch.Tensor,  # [T, H, D], unit stride along D; rotated in place
    k: torch.Tensor,  # [T, KV, D], same dtype; rotated in place
    positions: torch.Tensor,  # [T] int64
    cos_cache: torch.Tensor,  # [P, D] fp32
    sin_cache: torch.Tensor,  # [P, D] fp32
) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert k.shape == (num_tokens, num_k_heads, head_dim) and k.dtype == q.dtype
    assert head_dim % 2 == 0 and positions.shape == (num_tokens,)
    assert q.stride(2) == 1 and k.stride(2) == 1
    assert cos_cache.shape[1] == head_dim and sin_cache.shape == cos_cache.shape
    assert cos_cache.stride(1) == 1 and sin_cache.stride(1) == 1
    if num_tokens == 0:
        return
    half = head_dim // 2
    block_hq = triton.next_power_of_2(num_q_heads)
    block_half = triton.next_power_of_2(half)
    pdl = pdl_launch_kwargs(q)
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos_cache,
        sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_cache.stride(0),
        sin_cache.stride(0),
        num_q_heads,
        num_k_heads,
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_HQ=block_hq,
        BLOCK_HK=triton.next_power_of_2(num_k_heads),
        num_warps=4 if block_hq * block_half <= 2048 else 8,
        **pdl,
    )
