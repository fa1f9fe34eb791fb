"""Rotary embedding and the KV store of a layer's new tokens in one launch (instead of
kernels/fused_rotary.py's `apply_rotary_` then kernels/kv_store.py's `store_kv`): one program
per token rotates its q heads in place and writes its rotated k heads and its v heads into slot
loc[t] of the paged KV pool.

    q[t] = rope(q[t], pos[t]);  k_buf[loc[t]] = rope(k[t], pos[t]);  v_buf[loc[t]] = v[t]

k itself is left as it came: after the store nobody reads it (the Triton decode and extend
kernels read every key, the new tokens' included, from k_buf through req_to_token; FlashInfer's
wrappers from the paged pool), so writing it back would cost a store for nothing. The rotation
is fused_rotary.py's jit helpers, the same expressions, compiled without FMA contraction as
there (ROUNDING in fused_rotary.py), so the bits equal the two-kernel path's and the torch path's.

`KVPool.store_rotated` launches it whenever the Triton kernels are on. Decode graphs of up to 16
rows skip it: the decode kernel rotates and stores itself (decode_attention.DecodeRope, the same
bits).

Into a float8_e4m3fn pool (k_inv_scale / v_inv_scale given) the rotated k and v are quantized
on the way (kv_store.py's `quantize_e4m3`: the bits of rotary, then `KVPool.store`).

The grid depends only on T and nothing is allocated, so the launch can be captured in a CUDA
graph. NOTE: one program per token, as the two kernels it replaces. At batch-1 decode the launch
is one program moving ~48 KB (llama-8b, bf16: 48 heads of D=128 in, 48 out), whose time is
the latency of its chain (loads, rotate, stores); more programs over the heads would issue the
same loads side by side without shortening that chain.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchrun.kernels.fused_rotary import (
    _head_tile,
    _load_cos_sin,
    _load_halves,
    _rotate_half,
    _store_halves,
    check_cos_sin,
    rotary_launch_options,
)
from batchrun.kernels.kv_store import check_kv_dtypes, quantize_e4m3
from batchrun.kernels.pdl import pdl_launch_kwargs, pdl_wait


@triton.jit
def _rotary_store_kv_kernel(
    Q,
    K,
    V,
    KBuf,
    VBuf,
    Loc,
    Positions,
    Cos,
    Sin,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_loc,
    stride_buf_t,
    stride_cos,
    stride_sin,
    num_q_heads,
    num_kv_heads,
    k_inv_scale,
    v_inv_scale,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    FP8: tl.constexpr,  # the buffers hold float8_e4m3fn: quantize with the inverse scales
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # every input is an earlier kernel's output
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    offs_q, mask_q = _head_tile(stride_qh, num_q_heads, offs_d, mask_d, BLOCK_HQ)
    offs_k, mask_kv = _head_tile(stride_kh, num_kv_heads, offs_d, mask_d, BLOCK_HK)
    offs_v, _ = _head_tile(stride_vh, num_kv_heads, offs_d, mask_d, BLOCK_HK)
    offs_buf, _ = _head_tile(2 * HALF, num_kv_heads, offs_d, mask_d, BLOCK_HK)
    # NOTE: the token's q, k, v rows are loaded first, so that they are in flight together with
    # the position, the slot and then cos/sin (which wait for the position)
    q_ptr = Q + t * stride_qt
    q1, q2 = _load_halves(q_ptr, offs_q, mask_q, HALF)
    k1, k2 = _load_halves(K + t * stride_kt, offs_k, mask_kv, HALF)
    v1, v2 = _load_halves(V + t * stride_vt, offs_v, mask_kv, HALF)
    pos = tl.load(Positions + t).to(tl.int64)
    slot = tl.load(Loc + t * stride_loc).to(tl.int64)
    dtype = Q.dtype.element_ty
    c1, s1, c2, s2 = _load_cos_sin(
        Cos, Sin, pos, stride_cos, stride_sin, offs_d, mask_d, dtype, HALF
    )
    q1, q2 = _rotate_half(q1, q2, c1, s1, c2, s2)
    _store_halves(q_ptr, offs_q, mask_q, q1, q2, HALF)
    k1, k2 = _rotate_half(k1, k2, c1, s1, c2, s2)
    if FP8:
        k1 = quantize_e4m3(k1.to(tl.float32), k_inv_scale)
        k2 = quantize_e4m3(k2.to(tl.float32), k_inv_scale)
        v1 = quantize_e4m3(v1.to(tl.float32), v_inv_scale)
        v2 = quantize_e4m3(v2.to(tl.float32), v_inv_scale)
    _store_halves(KBuf + slot * stride_buf_t, offs_buf, mask_kv, k1, k2, HALF)
    _store_halves(VBuf + slot * stride_buf_t, offs_buf, mask_kv, v1, v2, HALF)


def rotary_store_kv(
    k_buf: torch.Tensor,  # [S + 1, KV, D] contiguous; written at rows loc
    v_buf: torch.Tensor,  # [S + 1, KV, D] contiguous, same dtype
    loc: torch.Tensor,  # [T] int64 or int32, slot per token
    q: torch.Tensor,  # [T, H, D] of the buffers' dtype, unit stride along D; rotated in place
    k: torch.Tensor,  # [T, KV, D] of that dtype, unit stride along D; read only
    v: torch.Tensor,  # [T, KV, D] of that dtype, unit stride along D; read only
    positions: torch.Tensor,  # [T] int64
    cos_cache: torch.Tensor,  # [P, D] fp32
    sin_cache: torch.Tensor,  # [P, D] fp32
    *,
    pdl: bool = False,  # launched with programmatic dependent launch (kernels/pdl.py)
    k_inv_scale: float | None = None,  # float8_e4m3fn buffers: 1 / the layer's k scale
    v_inv_scale: float | None = None,  # ... and v's
) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim) and head_dim % 2 == 0
    assert k_buf.shape == v_buf.shape and k_buf.shape[1:] == (num_kv_heads, head_dim)
    assert k_buf.is_contiguous() and v_buf.is_contiguous()
    assert q.dtype == k.dtype
    fp8 = check_kv_dtypes(k_buf, v_buf, k, v, k_inv_scale, v_inv_scale)
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert loc.shape == (num_tokens,) and loc.dtype in (torch.int32, torch.int64)
    assert positions.shape == (num_tokens,)
    check_cos_sin(cos_cache, sin_cache, head_dim)
    if num_tokens == 0:
        return
    launch = pdl_launch_kwargs(pdl, q)
    _rotary_store_kv_kernel[(num_tokens,)](
        q,
        k,
        v,
        k_buf,
        v_buf,
        loc,
        positions,
        cos_cache,
        sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        loc.stride(0),
        k_buf.stride(0),
        cos_cache.stride(0),
        sin_cache.stride(0),
        num_q_heads,
        num_kv_heads,
        k_inv_scale or 1.0,
        v_inv_scale or 1.0,
        FP8=fp8,
        **rotary_launch_options(num_q_heads, num_kv_heads, head_dim),
        **launch,
    )
