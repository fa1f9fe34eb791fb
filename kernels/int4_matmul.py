"""W4A16 matmul: y[M, N] = x[M, K] @ W^T for an INT4 weight in the layout of
batchrun/quant/int4_layout.py (int32 words of 8 output columns, K-major; scales and zeros
[num_groups, N]; act-order's permutation of x's columns), fp32 accumulation, y in x's dtype.

Each program owns a [BLOCK_M, BLOCK_N] tile of y and walks K in BLOCK_K steps: it loads x's
tile and the weight's [BLOCK_K, BLOCK_N / 8] words, unpacks them in registers (each word
repeated into its 8 columns by tl.interleave, one shift, one mask), dequantizes to x's dtype,
(q - zero) * scale computed in fp32 as Int4Weight.dequantize computes it, and feeds tl.dot. The
int-to-float conversion goes through the exponent: (q | 0x4B000000) read as fp32 is 2^23 + q,
one logic op where a conversion instruction runs at a fraction of the FP32 rate; the zero point
absorbs the 2^23.

Two shapes, a config table by M (`pick_config`; no autotuning: it costs start-up and breaks
graphs):
- decode (M <= DECODE_MAX_M): memory-bound, the weight read once; 16 to 64 rows a tile (the
  tensor cores pad the rest), and matrices with few column tiles split along K so that every SM
  has programs. x's columns are gathered by act-order's permutation as they are loaded (no
  kernel of its own). Split-K reduces in the kernel, deterministically, as kernels/gemv.py does
  (and on its counters): each slice stores its fp32 partial sums to its plane of a [SPLIT_K, M,
  N] workspace; the slice that arrives last sums the planes in slice order and writes y.
- prefill (larger M): compute-bound; 128-row tiles, programs grouped along M for L2 reuse of
  the weight tiles; act-order's x gathered once by index_select (its loads stay contiguous).

A K tile lies inside one group (BLOCK_K divides the group size, or one group per row): it
reads one row of scales and zeros. Where the layout keeps each column's group (a tensor-parallel
slice of an act-order weight), the tile gathers a scale and a zero per element instead.

The weight may also come in kernels/int4_gemv_mma.py's order (Int4MmaPacked: what an engine
layer keeps where that decode kernel takes it, so one copy of the weight serves decode and
prefill): a tile's words are then BLOCK_K / 64 runs of BLOCK_N * 8 contiguous words, each
word's eight nibbles split into an axis of their own, and one reshape and permute put the
values in [BLOCK_K, BLOCK_N] order (`_mma_order_values`).

No host syncs, no allocation that depends on data: the kernel runs inside CUDA graphs. The split
counters are allocated on first use: call `int4_matmul` once eagerly before capturing a graph
(`prepare` does it at load).

    y = int4_matmul(x, packed)                        # a config from pick_config(M, N, K)
    y = int4_matmul(x, packed, config=Int4Config(...))  # a config by hand
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from batchrun.kernels.gemv import NUM_COUNTERS, SplitRule, split_counters, split_k_for

from batchrun.quant.int4_layout import MMA_K, MMA_ROWS, Int4MmaPacked, Int4Packed

DECODE_MAX_M = 64
MAGIC = tl.constexpr(8388608.0)  # 2^23: (q | 0x4B000000) as fp32 is MAGIC + q


class Int4Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # prefill: programs grouped along M


# (largest M, config). Decode tiles stream 8 KB of packed weight per K step (BLOCK_K 128 x
# BLOCK_N 128 / 2) with 4 stages in flight; prefill tiles are Triton's Hopper bf16 shape.
CONFIGS: tuple[tuple[int, Int4Config], ...] = (
    (16, Int4Config(16, 128, 128, 4, 4)),
    (32, Int4Config(32, 128, 128, 4, 4)),
    (DECODE_MAX_M, Int4Config(64, 128, 64, 4, 4)),
    (256, Int4Config(64, 128, 64, 4, 4)),
    (1 << 62, Int4Config(128, 128, 64, 8, 3)),
)
# NOTE: split-K by kernels/gemv.py's rule: about two programs an SM of the H200 (132 SMs), only
# for matrices of at most 128 column tiles, slices of at least two K tiles
SPLIT = SplitRule(target_programs=256, max_split=16, min_tiles=2, max_tiles=128)


def pick_config(m: int, n: int, k: int) -> tuple[Int4Config, int]:
    """(config, split_k) for an [m, k] x [k, n] product."""
    cfg = next(c for max_m, c in CONFIGS if m <= max_m)
    split_k = 1
    if m <= DECODE_MAX_M:
        split_k = split_k_for(triton.cdiv(n, cfg.block_n), k, cfg.block_k, SPLIT)
    return cfg, split_k


@triton.jit
def _mma_order_values(QW, k0, k_end, pid_n, N, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The 4-bit values [BLOCK_K, BLOCK_N] (int32, zeros past k_end and N) of the tile at K row
    k0 and column tile pid_n of an Int4MmaPacked weight: word (s, r', m, b), nibble
    p = 4 b_k1 + 2 b_k8 + b_r8 holds q[n, k] with n = 16 (r' // 8) + 8 b_r8 + r' % 8 and
    k = 64 s + 16 m + 4 b + 2 b_k8 + b_k1 (batchrun/quant/int4_layout.py)."""
    STEPS: tl.constexpr = BLOCK_K // 64
    PAIRS: tl.constexpr = BLOCK_N // 2
    steps = k0 // 64 + tl.arange(0, STEPS)
    pairs = pid_n * PAIRS + tl.arange(0, PAIRS)
    t = tl.arange(0, 16)  # (m, b)
    offs = (steps[:, None, None].to(tl.int64) * (N // 2) + pairs[None, :, None]) * 16
    mask = (steps * 64 < k_end)[:, None, None] & (pairs < N // 2)[None, :, None]
    words = tl.load(QW + offs + t[None, None, :], mask=mask, other=0)  # [STEPS, PAIRS, 16]
    q = (words[:, :, :, None] >> (tl.arange(0, 8) * 4)[None, None, None, :]) & 0xF
    q = tl.reshape(q, [STEPS, BLOCK_N // 16, 8, 4, 4, 2, 2, 2])  # s R r m b b_k1 b_k8 b_r8
    q = tl.permute(q, (0, 3, 4, 6, 5, 1, 7, 2))  # s m b b_k8 b_k1 | R b_r8 r
    return tl.reshape(q, [BLOCK_K, BLOCK_N])


@triton.jit
def _dequant_tile(QW, S, Z, Groups, k0, k_end, offs_k, in_k, pid_n, offs_n, in_n, N, group_size,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ZEROS: tl.constexpr,
                  COLUMN_GROUPS: tl.constexpr, MMA_ORDER: tl.constexpr):  # fmt: skip
    """(q - zero) * scale in fp32 [BLOCK_K, BLOCK_N] of the weight tile at K rows offs_k (k0 on,
    zeros past k_end) and column tile pid_n, from either order."""
    if MMA_ORDER:
        q = _mma_order_values(QW, k0, k_end, pid_n, N, BLOCK_K, BLOCK_N)
    else:
        offs_w = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
        words = tl.load(
            QW + offs_k[:, None].to(tl.int64) * (N // 8) + offs_w[None, :],
            mask=in_k[:, None] & (offs_w < N // 8)[None, :],
            other=0,
        )  # [BLOCK_K, BLOCK_N / 8]
        words = tl.interleave(words, words)
        words = tl.interleave(words, words)
        words = tl.interleave(words, words)  # [BLOCK_K, BLOCK_N]: column n holds word n // 8
        q = (words >> ((tl.arange(0, BLOCK_N) % 8) * 4)[None, :]) & 0xF
    qf = (q | 0x4B000000).to(tl.float32, bitcast=True)  # MAGIC + q
    if COLUMN_GROUPS:
        g = tl.load(Groups + offs_k, mask=in_k, other=0)
        sz = g[:, None].to(tl.int64) * N + offs_n[None, :]
        sz_mask = in_k[:, None] & in_n[None, :]
        s = tl.load(S + sz, mask=sz_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(Z + sz, mask=sz_mask, other=0).to(tl.float32) + MAGIC
        else:
            z = MAGIC + 8.0
    else:
        row = (k0 // group_size).to(tl.int64) * N
        s = tl.load(S + row + offs_n, mask=in_n, other=0.0).to(tl.float32)[None, :]
        if HAS_ZEROS:
            z = tl.load(Z + row + offs_n, mask=in_n, other=0).to(tl.float32)[None, :] + MAGIC
        else:
            z = MAGIC + 8.0
    return (qf - z) * s


@triton.jit
def _int4_matmul_kernel(
    X,
    QW,
    S,
    Z,
    Perm,
    Groups,
    Y,
    WS,
    Counters,
    M,
    N,
    K,
    k_per_split,
    group_size,
    stride_xm,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    GATHER_X: tl.constexpr,  # x's columns through Perm as they are loaded
    COLUMN_GROUPS: tl.constexpr,  # each column's group from Groups (else k // group_size)
    MMA_ORDER: tl.constexpr,  # QW in Int4MmaPacked's order (BLOCK_K a multiple of 64)
    IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # programs grouped GROUP_M tiles along M: neighbours share the weight's column tiles in L2
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m = offs_m < M
    in_n = offs_n < N
    x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
    dtype = X.dtype.element_ty

    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < k_end
        cols = offs_k
        if GATHER_X:
            cols = tl.load(Perm + offs_k, mask=in_k, other=0)
        x = tl.load(x_rows + cols[None, :], mask=in_m[:, None] & in_k[None, :], other=0.0)
        w = _dequant_tile(QW, S, Z, Groups, k0, k_end, offs_k, in_k, pid_n, offs_n, in_n, N,
                          group_size, BLOCK_K, BLOCK_N, HAS_ZEROS, COLUMN_GROUPS,
                          MMA_ORDER).to(dtype)  # fmt: skip
        if IEEE:  # fp32 inputs: full precision, not tf32
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)

    out_mask = in_m[:, None] & in_n[None, :]
    out = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(Y.dtype.element_ty), mask=out_mask)
    else:  # one row tile (M <= BLOCK_M): the counter of column tile pid_n
        plane_stride = M * N
        plane = offs_m[:, None] * N + offs_n[None, :]
        tl.store(WS + pid_k * plane_stride + plane, acc, mask=out_mask)
        # NOTE: every thread's stores before the one release (as kernels/gemv.py): bar.sync,
        # then a gpu-scope acq_rel atomic; the last slice's acquire sees all the planes
        tl.debug_barrier()
        counter = Counters + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            # `.cg`: from L2, where the other slices' stores are
            total = tl.load(WS + plane, mask=out_mask, other=0.0, cache_modifier=".cg")
            for i in tl.static_range(1, SPLIT_K):
                part = WS + i * plane_stride + plane
                total += tl.load(part, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(out, total.to(Y.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next call


def int4_matmul(
    x: torch.Tensor,  # [M, K], unit stride along K; bf16 / fp16 (fp32 for the interpreter)
    w: Int4Packed | Int4MmaPacked,
    config: Int4Config | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """x @ W^T: [M, N] in x's dtype."""
    mma_order = isinstance(w, Int4MmaPacked)
    perm = groups = None
    if not mma_order:
        perm, groups = w.perm, w.groups
    m, k = x.shape
    n = w.out_features
    assert k == w.in_features and x.stride(1) == 1, (x.shape, x.stride(), w.in_features)
    cfg, auto_split = pick_config(m, n, k)
    if config is not None:
        cfg = config
    split = auto_split if split_k is None else split_k
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_k = cfg.block_k
    if groups is None and w.group_size < k:
        block_k = min(block_k, w.group_size)  # a K tile inside one group
    if x.dtype == torch.float32:  # 4-byte tiles: fit the shared memory
        block_k = min(block_k, 64)
    block_n = cfg.block_n
    if mma_order:  # whole 64-deep steps and 16-row MMA blocks (mma_pack's groups: whole steps)
        block_k, block_n = max(block_k, MMA_K), max(block_n, MMA_ROWS)
    gather = perm is not None and m <= DECODE_MAX_M
    if perm is not None and not gather:
        x = x.index_select(1, perm)
    tiles_m, tiles_n = triton.cdiv(m, cfg.block_m), triton.cdiv(n, block_n)
    if tiles_m > 1 or tiles_n > NUM_COUNTERS:
        split = 1
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    ws = y if split == 1 else torch.empty(split * m * n, dtype=torch.float32, device=x.device)
    counters = split_counters(x.device) if split > 1 else y
    # NOTE: absent operands get y as a stand-in pointer: their constexpr flag prunes every access
    _int4_matmul_kernel[(tiles_m * tiles_n, split)](
        x, w.qweight, w.scales, y if w.zeros is None else w.zeros,
        perm if gather else y, y if groups is None else groups, y, ws, counters,
        m, n, k, k_per_split, w.group_size, x.stride(0), y.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m,
        SPLIT_K=split, HAS_ZEROS=w.zeros is not None, GATHER_X=gather,
        COLUMN_GROUPS=groups is not None, MMA_ORDER=mma_order, IEEE=x.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y


def prepare(device: torch.device) -> None:
    """Allocate the split counters on `device` (before any CUDA graph capture)."""
    split_counters(device)
