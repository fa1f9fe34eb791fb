"""Store a step's new K and V into the paged KV pool in one launch: one program per token copies
all KV heads of its k row and of its v row into slot loc[t] of the k and v buffers.

    k_buf[loc[t]] = k[t];  v_buf[loc[t]] = v[t]   (t in [0, T))

It replaces the two torch index_put kernels of `KVPool.store`. A pure copy: the results equal the
torch path bit for bit. k and v may be strided views (slices of the fused qkv projection): any
token and head stride, unit stride along D. The grid depends only on T and nothing is allocated,
so the launch can be captured in a CUDA graph and replayed with new loc / k / v contents.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchrun.kernels.pdl import pdl_launch_kwargs, pdl_wait


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
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
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
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k_buf.shape == v_buf.shape and k_buf.shape[1:] == (num_kv_heads, head_dim)
    assert k_buf.is_contiguous() and v_buf.is_contiguous()
    assert v.shape == k.shape and k.dtype == v.dtype == k_buf.dtype == v_buf.dtype
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
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=num_warps,
        **launch,
    )
