"""Store a step's new K and V into the paged KV pool in one launch: one program per token copies
all KV heads of its k row and of its v row into slot loc[t] of the k and v buffers.

    k_buf[loc[t]] = k[t];  v_buf[loc[t]] = v[t]   (t in [0, T))

It replaces the two torch index_put kernels of `KVPool.store`. A pure copy: the results equal the
torch path bit for bit. Into a float8_e4m3fn pool (k_inv_scale / v_inv_scale given) each value is
quantized on the way, `quantize_e4m3`: the bits of batchrun/quant/kv_cache.py's `quantize_kv`.
k and v may be strided views (slices of the fused qkv projection): any token and head stride,
unit stride along D. The grid depends only on T and nothing is allocated, so the launch can be
captured in a CUDA graph and replayed with new loc / k / v contents.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchrun.kernels.pdl import pdl_launch_kwargs, pdl_wait


@triton.jit
def quantize_e4m3(x, inv_scale):
    """float8e4nv(clamp(x * inv_scale, -448, 448)), rounded to nearest even: x fp32.

    NOTE: the rounding is done here in float32 arithmetic, so the conversion that follows only
    re-encodes a value e4m3 holds exactly. Triton's CPU interpreter rounds float32 -> e4m3
    half-up and loses the carry into the exponent (127.99 -> 64); the GPU's cvt.rn.satfinite is
    exact. Both then give torch's bits. The rounding: with u the e4m3 spacing at |y| (2^(e - 3)
    for |y| in [2^e, 2^(e + 1)), 2^-9 below 2^-6, the subnormals) and C = u * 2^23, |y| + C has
    float32 spacing u, so the addition rounds |y| to a multiple of u, to even, and subtracting
    C is exact."""
    y = tl.clamp(x * inv_scale, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    bits = y.to(tl.int32, bitcast=True)
    a = tl.abs(y)
    e = a.to(tl.int32, bitcast=True) >> 23  # the biased exponent (a >= 0)
    big = ((tl.maximum(e - 3, 127 - 9) + 23) << 23).to(tl.float32, bitcast=True)  # C
    r = (a + big) - big
    r = (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)
    return r.to(tl.float8e4nv)


@triton.jit
def _store_kv_kernel(
    KBuf,
    VBuf,
    Loc,
    K,
    V,
    stride_loc,
    stride_buf_t,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    num_kv_heads,
    k_inv_scale,
    v_inv_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,  # the buffers hold float8_e4m3fn: quantize with the inverse scales
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # every input is an earlier kernel's output
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + t * stride_loc).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # NOTE: a [BLOCK_H, BLOCK_D] tile, not a flat KV * D range, so that strided heads work and
    # KV (1..8, e.g. 3) need not be a power of two; the mask trims the padding heads
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    offs_k = t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]  # [BLOCK_H, BLOCK_D]
    offs_v = t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    # both loads before either store, so the two reads are in flight together
    k = tl.load(K + offs_k, mask=mask)
    v = tl.load(V + offs_v, mask=mask)
    if FP8:
        k = quantize_e4m3(k.to(tl.float32), k_inv_scale)
        v = quantize_e4m3(v.to(tl.float32), v_inv_scale)
    offs_buf = slot * stride_buf_t + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(KBuf + offs_buf, k, mask=mask)
    tl.store(VBuf + offs_buf, v, mask=mask)


def store_kv(
    k_buf: torch.Tensor,  # [S + 1, KV, D] contiguous; written at rows loc
    v_buf: torch.Tensor,  # [S + 1, KV, D] contiguous, same dtype
    loc: torch.Tensor,  # [T] int64 or int32, slot per token, on the buffers' device
    k: torch.Tensor,  # [T, KV, D] of the buffers' dtype, unit stride along D
    v: torch.Tensor,  # [T, KV, D] of the buffers' dtype, unit stride along D
    *,
    pdl: bool = False,  # launched with programmatic dependent launch (kernels/pdl.py)
    k_inv_scale: float | None = None,  # float8_e4m3fn buffers: 1 / the layer's k scale
    v_inv_scale: float | None = None,  # ... and v's
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k_buf.shape == v_buf.shape and k_buf.shape[1:] == (num_kv_heads, head_dim)
    assert k_buf.is_contiguous() and v_buf.is_contiguous()
    fp8 = check_kv_dtypes(k_buf, v_buf, k, v, k_inv_scale, v_inv_scale)
    assert v.shape == k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1
    assert loc.shape == (num_tokens,) and loc.dtype in (torch.int32, torch.int64)
    if num_tokens == 0:
        return
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    # about 8 elements of each of k and v per thread (16-byte accesses in bf16/fp16)
    num_warps = min(max(block_h * block_d // 256, 1), 8)
    launch = pdl_launch_kwargs(pdl, k)
    _store_kv_kernel[(num_tokens,)](
        k_buf,
        v_buf,
        loc,
        k,
        v,
        loc.stride(0),
        k_buf.stride(0),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        num_kv_heads,
        k_inv_scale or 1.0,
        v_inv_scale or 1.0,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        FP8=fp8,
        num_warps=num_warps,
        **launch,
    )


def check_kv_dtypes(k_buf, v_buf, k, v, k_inv_scale, v_inv_scale) -> bool:
    """Whether a store quantizes (float8_e4m3fn buffers, with both inverse scales given); else
    k, v and the buffers share one dtype."""
    assert k.dtype == v.dtype and k_buf.dtype == v_buf.dtype
    fp8 = k_buf.dtype == torch.float8_e4m3fn
    assert fp8 == (k_inv_scale is not None) == (v_inv_scale is not None), "scales: fp8 only"
    assert fp8 or k.dtype == k_buf.dtype
    return fp8
