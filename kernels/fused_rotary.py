"""Neox-style (rotate-half) rotary embedding of q and k in place, in one launch: one program per
token covers all of its q and k heads.

    x = [x1 | x2] (halves of D), c = cos_cache[pos].to(dtype), s = sin_cache[pos].to(dtype)
    out = [x1 * c1 - x2 * s1 | x2 * c2 + x1 * s2]

Partial rotary (Phi-3 / Phi-4: cos_cache [P, R] with R < D): x1, x2 are the halves of the first
R dims, which rotate in place; dims [R, D) are left as they are. kernels/rotary_kv_store.py and
the decode kernel's rotary (kernels/decode_attention.py) rotate whole heads only:
KVPool.fuses_rotary sends a partial-rotary model to this kernel and a store apart.

Numerics are those of `batchrun.layers.rotary._apply_rotary` (HF transformers): every product
and the sum are rounded to the activation dtype, as torch's unfused elementwise ops round each
result. ROUNDING: the kernels are compiled with `enable_fp_fusion=False`. With FMA contraction
on, sm_90 code computes `x1 * c1 - x2 * s1` as one fma.rn.bf16 (one product unrounded), and which
product goes into the FMA can differ between this kernel and kernels/rotary_kv_store.py, whose
bits then differ. Without it the bits equal the torch path's in every dtype.

q and k may be strided views (slices of the fused qkv projection): only the last dim must be
contiguous. kernels/rotary_kv_store.py reuses the jit helpers (`_load_cos_sin`, `_rotate_half`),
so its rotation gives these bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchrun.kernels.pdl import pdl_launch_kwargs, pdl_wait


@triton.jit
def _load_cos_sin(
    Cos, Sin, pos, stride_cos, stride_sin, offs_d, mask_d, dtype: tl.constexpr, HALF: tl.constexpr
):
    """(c1, s1, c2, s2): the halves of cos/sin at `pos`, each [1, BLOCK_HALF] fp32. Rounded to
    the activation dtype first, as `cos.to(x.dtype)` in the torch path."""
    cos_ptr = Cos + pos * stride_cos + offs_d
    sin_ptr = Sin + pos * stride_sin + offs_d
    c1 = tl.load(cos_ptr, mask=mask_d, other=0.0).to(dtype).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + HALF, mask=mask_d, other=0.0).to(dtype).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr, mask=mask_d, other=0.0).to(dtype).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + HALF, mask=mask_d, other=0.0).to(dtype).to(tl.float32)[None, :]
    return c1, s1, c2, s2


@triton.jit
def _head_tile(stride_h, num_heads, offs_d, mask_d, BLOCK_H: tl.constexpr):
    """(offsets, mask) of the first halves of heads [0, num_heads): [BLOCK_H, BLOCK_HALF]."""
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < num_heads)[:, None] & mask_d[None, :]
    return offs_h[:, None] * stride_h + offs_d[None, :], mask


@triton.jit
def _rotate_half(x1, x2, c1, s1, c2, s2):
    """(x1 * c1 - x2 * s1, x2 * c2 + x1 * s2) in x's dtype, from halves x1, x2 in that dtype."""
    dtype = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    # NOTE: round each product before the sum, as torch's `x * cos + rotated * sin` does
    y1 = (a1 * c1).to(dtype).to(tl.float32) - (a2 * s1).to(dtype).to(tl.float32)
    y2 = (a2 * c2).to(dtype).to(tl.float32) + (a1 * s2).to(dtype).to(tl.float32)
    return y1.to(dtype), y2.to(dtype)


@triton.jit
def _load_halves(X, offs, mask, HALF: tl.constexpr):
    return tl.load(X + offs, mask=mask, other=0.0), tl.load(X + offs + HALF, mask=mask, other=0.0)


@triton.jit
def _store_halves(X, offs, mask, x1, x2, HALF: tl.constexpr):
    tl.store(X + offs, x1, mask=mask)
    tl.store(X + offs + HALF, x2, mask=mask)


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
    """Rotate heads [0, num_heads) of one token in place; X points at head 0, dim 0."""
    offs, mask = _head_tile(stride_h, num_heads, offs_d, mask_d, BLOCK_H)
    x1, x2 = _load_halves(X, offs, mask, HALF)
    y1, y2 = _rotate_half(x1, x2, c1, s1, c2, s2)
    _store_halves(X, offs, mask, y1, y2, HALF)


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
    c1, s1, c2, s2 = _load_cos_sin(
        Cos, Sin, pos, stride_cos, stride_sin, offs_d, mask_d, dtype, HALF
    )
    q_ptr = Q + t * stride_qt
    _rotate_heads(q_ptr, stride_qh, num_q_heads, c1, s1, c2, s2, offs_d, mask_d, HALF, BLOCK_HQ)
    k_ptr = K + t * stride_kt
    _rotate_heads(k_ptr, stride_kh, num_k_heads, c1, s1, c2, s2, offs_d, mask_d, HALF, BLOCK_HK)


def check_cos_sin(cos_cache: torch.Tensor, sin_cache: torch.Tensor, width: int) -> None:
    """cos/sin tables [P, width], unit stride along the width."""
    assert cos_cache.shape[1] == width and sin_cache.shape == cos_cache.shape
    assert cos_cache.stride(1) == 1 and sin_cache.stride(1) == 1


def rotary_launch_options(num_q_heads: int, num_k_heads: int, rotary_dim: int) -> dict:
    """The constexprs and options of a launch that rotates one token a program (this module's
    kernel and kernels/rotary_kv_store.py's), rotating the first rotary_dim dims of a head."""
    half = rotary_dim // 2
    block_hq, block_half = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(half)
    return dict(
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_HQ=block_hq,
        BLOCK_HK=triton.next_power_of_2(num_k_heads),
        num_warps=4 if block_hq * block_half <= 2048 else 8,
        enable_fp_fusion=False,  # see ROUNDING above
    )


def apply_rotary_(
    q: torch.Tensor,  # [T, H, D], unit stride along D; rotated in place
    k: torch.Tensor,  # [T, KV, D], same dtype; rotated in place
    positions: torch.Tensor,  # [T] int64
    cos_cache: torch.Tensor,  # [P, R] fp32, R <= D: the first R dims of each head rotate
    sin_cache: torch.Tensor,  # [P, R] fp32
    *,
    pdl: bool = False,  # launched with programmatic dependent launch (kernels/pdl.py)
) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    rotary_dim = cos_cache.shape[1]
    assert k.shape == (num_tokens, num_k_heads, head_dim) and k.dtype == q.dtype
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim and positions.shape == (num_tokens,)
    assert q.stride(2) == 1 and k.stride(2) == 1
    check_cos_sin(cos_cache, sin_cache, rotary_dim)
    if num_tokens == 0:
        return
    launch = pdl_launch_kwargs(pdl, q)
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
        **rotary_launch_options(num_q_heads, num_k_heads, rotary_dim),
        **launch,
    )
