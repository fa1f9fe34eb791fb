"""Causal attention of new tokens (prefill / extend) over the token-indexed paged KV.

Grid (B, ceil(max_extend_len / BLOCK_M), KV): one program per (request, query block, KV head),
which attends all of that KV head's query heads at once (GQA packing): its query tile holds
BLOCK_M tokens x PACK heads (PACK = the group size's power of two, the padding heads masked),
row r being token m0 + r // PACK, head kv_head * group + r % PACK. Each K / V block is read once
for the group, not once per query head (a model without GQA packs one head: PACK 1). The
request's KV (cached prefix + new tokens, already stored in the pool) is read through
req_to_token:

    KV positions of request b:  [0 ............ prefix_len ............ seq_len)
                                                |<- queries: extend_len ->|
    query block [m0, m0 + BLOCK_M) sits at positions prefix_len + m0 + i
    keys [0, full_end)           visible to every query row of the block: no mask
    keys [full_end, causal_end)  the diagonal: key k visible to row i iff k <= prefix_len + m0 + i
    with full_end = (prefix_len + m0) rounded down to BLOCK_N, causal_end = min(seq_len,
    prefix_len + m0 + BLOCK_M).

A sliding window W (`window=`, a runtime value: one compiled kernel for every W) hides key k
from the query at position p unless p - W < k <= p. The block's KV loop then starts at its first
query's window, and the keys the window cuts for some row of the block are masked:

    keys [0, win_start)            seen by no row of the block: never loaded
    keys [win_start, win_full)     the window's edge: key k visible to row i iff
                                   k > prefix_len + m0 + i - W (and the diagonal's rule)
    keys [win_full, full_end)      visible to every row: no mask
    with win_start = (prefix_len + m0 - W + 1) rounded down to BLOCK_N (0 at least),
    win_full = (causal_end - W) rounded up to BLOCK_N (0 at least): the last row's window start.
    Where win_full passes full_end the edge stops at full_end, and the diagonal's blocks carry
    both masks.

Online softmax in fp32 (base 2, the scale folded into log2(e)). Attention sinks (gpt-oss,
`sinks=` [H] fp32) start each row's softmax from its head's sink logit: max sink * log2(e), sum 1
(its term in the denominator), acc 0. A float8_e4m3fn pool
(`kv_scale=` given): K and V convert to q's dtype as they are loaded (exact), the layer's k scale
is folded into the softmax scale and its v scale multiplies the normalized output.

BLOCK_N and the stages shrink where the tiles would not fit the device's shared memory (head
dim 512: kernels/tile_fit.py's rule).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from batchrun.kernels.decode_attention import check_kv_scale
from batchrun.kernels.tile_fit import fit_kv_tiles, shared_memory_limit

if TYPE_CHECKING:
    from batchrun.quant.kv_cache import KVScale

LOG2E = 1.4426950408889634

# defaults: the best of 8 (BLOCK_M, BLOCK_N, warps) configurations on the H200 (8 x 1024 new
# tokens, GQA 32/8, D 128, bf16) at prefix 0 and 1024 (docs/benchmarks.md, Kernels: Extend
# attention)
DEFAULT_BLOCK_N = 64
DEFAULT_NUM_STAGES = 2
# packed (GQA) programs: query rows (tokens x PACK heads) a program: 16 tokens x 4 heads,
# BLOCK_N 64, 4 warps, 2 stages beat one head a program and 32 or 64 tokens a program
# (docs/benchmarks.md, Kernels: Extend attention)
DEFAULT_PACKED_ROWS = 64
DEFAULT_PACKED_WARPS = 4
# long extends (LONG_EXTEND new tokens or more in a request; GQA, head dim <= 128): 256 query rows
# (64 tokens x 4 heads), 8 warps: faster than the 64-row default on long prefills and long
# prefixes (docs/benchmarks.md, Kernels: Extend attention), though ptxas keeps 255 registers and
# spills 272 bytes a thread at D 128 (`scripts/check_kernels_compile.py --ptxas`)
LONG_EXTEND = 4096
LONG_PACKED_ROWS = 256
LONG_PACKED_WARPS = 8


@triton.jit
def _attend_block(
    q,
    acc,
    l_i,
    m_i,
    k_head,
    v_head,
    r2t,
    n0,
    q_pos,
    causal_end,
    offs_d,
    mask_d,
    stride_kt,
    stride_vt,
    sm_scale_log2,
    window,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        mask_n = offs_n < causal_end
        slots = tl.load(r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
    else:
        slots = tl.load(r2t + offs_n).to(tl.int64)
        kv_mask = mask_d[None, :]
    k = tl.load(k_head + slots[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
    k = k.to(q.dtype)  # a float8 pool's values convert exactly
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2  # [M, N]
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        if WINDOWED:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_head + slots[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["window"])
def _extend_kernel(
    Q,
    K,
    V,
    Out,
    ReqToToken,
    ReqPoolIndices,
    SeqLens,
    ExtendLens,
    ExtendStartLoc,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_r2t,
    sm_scale_log2,  # the softmax scale times log2(e), times the k scale of a float8 pool
    v_scale,  # KV_FP8: the layer's v scale, on the output
    window,  # WINDOWED: the sliding window W (> 0)
    KV_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query tokens a program
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PACK: tl.constexpr,  # query heads a program: KV_GROUP's power of two (grid axis 2: KV)
    KV_FP8: tl.constexpr,  # K and V hold float8_e4m3fn
    WINDOWED: tl.constexpr,  # a sliding window: keys before each row's window are hidden
    Sinks,  # HAS_SINKS: [H] fp32, each head's sink logit
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    extend_len = tl.load(ExtendLens + b).to(tl.int32)
    if m0 >= extend_len:
        return
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    prefix_len = seq_len - extend_len
    q_start = tl.load(ExtendStartLoc + b).to(tl.int64)
    row = tl.load(ReqPoolIndices + b).to(tl.int64)

    # row r of the query tile: token m0 + r // PACK, head r % PACK of the program's group
    offs_r = tl.arange(0, BLOCK_M * PACK)
    offs_m = m0 + offs_r // PACK
    kvh = tl.program_id(2)
    sub = offs_r % PACK
    heads = kvh * KV_GROUP + sub
    mask_m = (offs_m < extend_len) & (sub < KV_GROUP)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_rows = q_start + offs_m.to(tl.int64)
    q = tl.load(
        Q + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_M * PACK, BLOCK_D]
    q_pos = prefix_len + offs_m  # padded rows sit past seq_len and see every key: finite

    m_i = tl.full([BLOCK_M * PACK], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * PACK], dtype=tl.float32)
    if HAS_SINKS:  # each row starts from its head's sink: max sink (base 2), sum 2^0 = 1
        m_i = tl.load(Sinks + heads, mask=sub < KV_GROUP, other=0.0).to(tl.float32)
        m_i = m_i * 1.4426950408889634
        l_i = tl.full([BLOCK_M * PACK], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * PACK, BLOCK_D], dtype=tl.float32)
    r2t = ReqToToken + row * stride_r2t
    k_head = K + kvh * stride_kh
    v_head = V + kvh * stride_vh
    full_end = (prefix_len + m0) // BLOCK_N * BLOCK_N
    causal_end = tl.minimum(seq_len, prefix_len + m0 + BLOCK_M)
    unmasked_start = 0
    if WINDOWED:  # the window's edge (the module docstring)
        win_start = tl.maximum(prefix_len + m0 - window + 1, 0) // BLOCK_N * BLOCK_N
        win_full = tl.cdiv(tl.maximum(causal_end - window, 0), BLOCK_N) * BLOCK_N
        unmasked_start = tl.minimum(win_full, full_end)
        for n0 in range(win_start, unmasked_start, BLOCK_N):
            acc, l_i, m_i = _attend_block(
                q, acc, l_i, m_i, k_head, v_head, r2t, n0, q_pos, causal_end, offs_d, mask_d,
                stride_kt, stride_vt, sm_scale_log2, window, BLOCK_N, True, DOT_PRECISION, True,
            )  # fmt: skip
    for n0 in range(unmasked_start, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_block(
            q, acc, l_i, m_i, k_head, v_head, r2t, n0, q_pos, causal_end, offs_d, mask_d,
            stride_kt, stride_vt, sm_scale_log2, window, BLOCK_N, False, DOT_PRECISION, False,
        )  # fmt: skip
    for n0 in range(full_end, causal_end, BLOCK_N):
        acc, l_i, m_i = _attend_block(
            q, acc, l_i, m_i, k_head, v_head, r2t, n0, q_pos, causal_end, offs_d, mask_d,
            stride_kt, stride_vt, sm_scale_log2, window, BLOCK_N, True, DOT_PRECISION, WINDOWED,
        )  # fmt: skip

    if KV_FP8:
        l_i = l_i / v_scale  # the output times the v scale
    out = acc / l_i[:, None]
    tl.store(
        Out + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def extend_attention_fwd(
    q: torch.Tensor,  # [T, H, D], the new tokens of all requests, request after request
    k_buf: torch.Tensor,  # [num_slots + 1, KV, D]
    v_buf: torch.Tensor,  # [num_slots + 1, KV, D]
    out: torch.Tensor,  # [T, H, D], written
    req_to_token: torch.Tensor,  # [max_reqs + 1, max_context] int32
    req_pool_indices: torch.Tensor,  # [B] int64
    seq_lens: torch.Tensor,  # [B] int64, KV length including the new tokens
    extend_lens: torch.Tensor,  # [B] int64
    extend_start_loc: torch.Tensor,  # [B] int64, exclusive cumsum of extend_lens
    max_extend_len: int,
    scaling: float,
    *,
    block_m: int | None = None,  # query tokens a program (a power of two)
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    kv_scale: KVScale | None = None,  # float8_e4m3fn buffers: the layer's scales
    window: int = 0,  # sliding window: each query sees the last `window` positions (0: all)
    sinks: torch.Tensor | None = None,  # [H] fp32: each head's sink logit (gpt-oss)
    shared_memory: int | None = None,  # the tiles' byte limit (None: q's device's, if a GPU)
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    if sinks is not None:
        assert sinks.shape == (num_heads,) and sinks.dtype == torch.float32, sinks.shape
    batch_size = req_pool_indices.shape[0]
    num_kv_heads = k_buf.shape[1]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert q.stride(2) == 1 and out.stride(2) == 1
    assert k_buf.stride(2) == 1 and v_buf.stride(2) == 1 and req_to_token.stride(1) == 1
    kv_fp8 = check_kv_scale(q, k_buf, v_buf, kv_scale)
    scale = kv_scale if kv_fp8 else None
    if batch_size == 0 or max_extend_len == 0:
        return
    kv_group = num_heads // num_kv_heads
    pack = triton.next_power_of_2(kv_group)
    long = max_extend_len >= LONG_EXTEND and pack > 1 and head_dim <= 128
    rows = LONG_PACKED_ROWS if long else DEFAULT_PACKED_ROWS
    block_m = block_m or max(1, rows // pack)
    num_warps = num_warps or (LONG_PACKED_WARPS if long else DEFAULT_PACKED_WARPS)
    assert block_m * pack >= 16, "tl.dot needs 16 query rows a program"
    # wide heads (Gemma 4's 512) shrink the KV tiles to the device's shared memory (tile_fit.py)
    limit = shared_memory if shared_memory is not None else shared_memory_limit(q.device)
    block_n, num_stages = fit_kv_tiles(
        block_m * pack,
        head_dim,
        block_n or DEFAULT_BLOCK_N,
        num_stages or DEFAULT_NUM_STAGES,
        q.element_size(),
        k_buf.element_size(),
        limit,
    )
    grid = (batch_size, triton.cdiv(max_extend_len, block_m), num_kv_heads)
    _extend_kernel[grid](
        q,
        k_buf,
        v_buf,
        out,
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_lens,
        extend_start_loc,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        scaling * LOG2E * (scale.k if scale else 1.0),
        scale.v if scale else 1.0,
        max(window, 0),
        KV_GROUP=kv_group,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PACK=pack,
        KV_FP8=kv_fp8,
        WINDOWED=window > 0,
        Sinks=q if sinks is None else sinks,  # (a stand-in that HAS_SINKS prunes)
        HAS_SINKS=sinks is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
