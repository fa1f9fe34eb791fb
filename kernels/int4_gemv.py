"""W4A16 decode matmul: y[M, N] = x[M, K] @ W^T for M <= 16 and an INT4 weight in the layout of
batchrun/quant/int4_layout.py, optionally with the SwiGLU gate as its epilogue (a fused gate_up
-> silu(gate) * up). Memory-bound: the packed weight is read once, at close to HBM bandwidth.

A program owns BLOCK_N output columns (BLOCK_N / 8 int32 words a K row) and, with SPLIT_K > 1,
one K slice of them; it streams [BLOCK_K, BLOCK_N / 8] word tiles (BLOCK_N / 2 contiguous bytes a
row: 128 at BLOCK_N 256, one cache line). No interleave, no reshape: nibble j of each word is
the tile of columns 8c + j, [BLOCK_K, BLOCK_N / 8], and feeds its own tl.dot (x padded to 16
rows, as kernels/gemv.py does: the tensor cores do the padding rows for free). Eight fp32
accumulators a program, one a nibble; y's columns are stored 8 apart.

Nibbles j and j + 4 become the dots' operands together, on the GPU in two instructions a word:
a shift by 4j, then one lop3 ((w & 0x000F000F) | EXP EXP) whose 16-bit halves are the bf16
(fp16) numbers OFFSET + q of both (OFFSET 128 for bf16: its ulp there is 1; 1024 for fp16),
split by a register move (inline PTX; the interpreter masks and bitcasts each half). The zero
point and the scale apply after the dot, once a tile and column (a K tile lies inside one
group):

    sum_k (q - z) * s * x[k] = s * (dot(x, OFFSET + q) - (OFFSET + z) * sum_k x[k])

x times OFFSET + q is exact in fp32 (8 significant bits each for bf16), so the only roundings
are the fp32 sums; the weight is never rounded to bf16 (Int4Weight.dequantize(bf16) rounds each
(q - z) * s once: the two differ by the fp32 sums' order and that rounding, far inside the
format's bound). fp32 inputs (Triton's CPU interpreter, whose tl.dot is wrong for bf16) take q
as fp32 and OFFSET 0.

Each iteration loads its own word and x tiles and Triton's pipeliner streams them through
shared memory num_stages - 1 tiles ahead (asynchronous copies): a word tile is then read from
shared memory into the dot's operand layout once and its eight nibble tiles are made there. A
tile carried through the loop by hand (loaded two iterations ahead into registers) keeps its
load's layout instead, and each nibble tile then crosses shared memory on its own (eight
stores, loads and barrier pairs a tile: 18 barriers and 790 instructions a 64 x 256 tile at
M = 1 against 3 and 622; scripts/check_kernels_compile.py --sass, Triton 3.6, sm_90). Before
the PDL wait (weights are no earlier kernel's output: the prefetches overlap the kernel before;
kernels/pdl.py) the slice's first two word tiles and its groups' scale and zero rows are
prefetched into L2 (inline PTX, on the GPU only).

Split-K reduces in the kernel, deterministically, on kernels/gemv.py's counters and helpers:
each slice stores its fp32 sums to its plane of a [SPLIT_K, M, N] workspace ([SPLIT_K, M, 2N]
with swiglu), the slice that arrives last sums the planes in slice order and writes y. An
act-order weight (`perm`: x's columns gathered by its permutation, and `groups`: a
tensor-parallel slice of one) is not taken here: kernels/int4_matmul.py runs it, whose
act-order path the GPU tests check (tests/gpu/test_int4_kernel_gpu.py).

One row (x [1, K]) runs on a second kernel, on the CUDA cores (`Int4GemvConfig(fma=True)`,
pick_fma_config; pick_config takes it at M = 1): each thread streams one word column down its
rows of a K tile, makes each nibble the fp32 number 1 + q / 16 with a shift and a lop3 and adds
x[k] times it by an FMA, so the sums over K stay inside the thread until the loop ends, and
the split-K planes are stored nibble-major so the last slice reads them in one load. For
sm_90 its loop takes 4.0 instructions a weight value and no shared memory or barrier under
Triton 3.6 and 3.9, and 56 registers under 3.6 (scripts/check_kernels_compile.py --ptxas
--sass). On one H100 (scripts/bench_int4_matmul.py --models llama-8b --m 1) it takes
llama-8b's qkv in 11.2 us (the tensor-core kernel 21.0), o 9.0 (16.4), gate_up with the SwiGLU
gate 33.1, down 23.6 (35.3): a decode step's matmuls 2.64 ms against 5.14 and the bf16 GEMV's
4.85.

No host syncs, no allocation that depends on data: the kernels run inside CUDA graphs (the
split counters are allocated on first use: call once eagerly before capturing).

    y = int4_gemv(x, packed)                           # a config from pick_config(M, N, K)
    a = int4_gemv(x, packed_gate_up, swiglu=True)       # silu(gate) * up, [M, N / 2]
    y = int4_gemv(x, packed, config=Int4GemvConfig(...))  # scripts/bench_int4_matmul.py
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from batchrun.kernels.gemv import NUM_COUNTERS, _sum_planes, _write_y, split_counters
from batchrun.kernels.pdl import pdl_launch_kwargs, pdl_wait

from batchrun.quant.int4_layout import PACK, Int4Packed

MAX_M = 16
# the low 16 bits OR-ed onto a nibble: the bf16 / fp16 number OFFSET + q (OFFSET: its ulp is 1)
EXP_BITS = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}


class Int4GemvConfig(NamedTuple):
    block_n: int = 256  # output columns a program: block_n / 8 words a K row
    block_k: int = 64  # K rows a tile (clamped to divide the group size)
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3  # word and x tiles in flight (Triton's pipeliner)
    fma: bool = False  # M = 1: the CUDA-core kernel (_int4_gemv_fma_kernel), no tensor cores


def takes(w: Int4Packed, m: int, swiglu: bool = False) -> bool:
    """Whether int4_gemv runs x [m, K] @ W^T: a decode batch (m <= MAX_M) of a weight without
    act-order's permutation (x read in order, groups runs along K); with swiglu, halves of
    whole words."""
    halves = not swiglu or w.out_features % (2 * PACK) == 0
    return m <= MAX_M and w.perm is None and w.groups is None and halves


@triton.jit
def _words(QW, offs_k, k_end, offs_c, in_c, n_words):
    """The word tile [BLOCK_K, BLOCK_N / 8] at K rows offs_k (zeros past k_end)."""
    mask = (offs_k < k_end)[:, None] & in_c[None, :]
    ptrs = QW + offs_k[:, None].to(tl.int64) * n_words + offs_c[None, :]
    return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def _sz(S, Z, row, cols, in_c, HAS_ZEROS: tl.constexpr):
    """The scales and zero points (fp32, [BLOCK_N / 8]) of the columns cols in group row `row`
    (an offset); symmetric zeros are 8."""
    s = tl.load(S + row + cols, mask=in_c, other=0.0).to(tl.float32)
    z = tl.full(s.shape, 8.0, tl.float32)
    if HAS_ZEROS:
        z = tl.load(Z + row + cols, mask=in_c, other=0).to(tl.float32)
    return s, z


@triton.jit
def _group_rows(S, Z, k0, group_size, N, offs_c, in_c, HAS_ZEROS: tl.constexpr):
    """The scales and zero points of the K tile at k0 for the columns 8c + j, one [BLOCK_N / 8]
    vector each, j = 0 .. 7: (s0, ..., s7, z0, ..., z7). Loaded in the layout the dot's result
    takes them in (no conversion a tile)."""
    row = (k0 // group_size).to(tl.int64) * N
    c8 = offs_c * 8
    s0, z0 = _sz(S, Z, row, c8, in_c, HAS_ZEROS)
    s1, z1 = _sz(S, Z, row, c8 + 1, in_c, HAS_ZEROS)
    s2, z2 = _sz(S, Z, row, c8 + 2, in_c, HAS_ZEROS)
    s3, z3 = _sz(S, Z, row, c8 + 3, in_c, HAS_ZEROS)
    s4, z4 = _sz(S, Z, row, c8 + 4, in_c, HAS_ZEROS)
    s5, z5 = _sz(S, Z, row, c8 + 5, in_c, HAS_ZEROS)
    s6, z6 = _sz(S, Z, row, c8 + 6, in_c, HAS_ZEROS)
    s7, z7 = _sz(S, Z, row, c8 + 7, in_c, HAS_ZEROS)
    return s0, s1, s2, s3, s4, s5, s6, s7, z0, z1, z2, z3, z4, z5, z6, z7


@triton.jit
def _prefetch_l2(ptrs):
    """prefetch.global.L2 of each address (a hint: nothing is loaded into registers)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _prefetch_tiles(QW, k_start, k_end, first_word, n_words, BLOCK_K: tl.constexpr,
                    ASM: tl.constexpr):  # fmt: skip
    """Prefetch into L2 the first two word tiles of a K slice (one address a row's 128-byte
    line, at the program's first word column). GPU only."""
    if ASM:
        rows = k_start + tl.arange(0, 2 * BLOCK_K)
        rows = tl.minimum(rows, k_end - 1).to(tl.int64)
        _prefetch_l2(QW + rows * n_words + first_word)


@triton.jit
def _prefetch_scales(S, Z, k_start, k_end, group_size, n_rows, first_col, BLOCK_N: tl.constexpr,
                     HAS_ZEROS: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """Prefetch into L2 the scale and zero rows of the K slice's groups (at most 64 groups; the
    program's BLOCK_N columns, one address a 128-byte line). GPU only."""
    if ASM:
        first, last = k_start // group_size, (k_end - 1) // group_size
        g = tl.minimum(first + tl.arange(0, 64), last).to(tl.int64)
        base = g[:, None] * n_rows + first_col
        lines = tl.arange(0, BLOCK_N // 64)  # 64 two-byte scales a line
        _prefetch_l2(S + base + lines[None, :] * 64)
        if HAS_ZEROS:
            lines = tl.arange(0, BLOCK_N // 128)  # 128 one-byte zeros a line
            _prefetch_l2(Z + base + lines[None, :] * 128)


@triton.jit
def _scaled(acc, d, xs, s_j, z_j, OFFSET: tl.constexpr):
    """acc + s_j * (d - (OFFSET + z_j) * sum(x)): a nibble's dot d = x @ (OFFSET + q) with its
    columns' scales and zero points applied."""
    return acc + (d - (z_j + OFFSET)[None, :] * xs[:, None]) * s_j[None, :]


@triton.jit
def _offset_pair(shifted, EXP: tl.constexpr, ASM: tl.constexpr):
    """(OFFSET + q_lo, OFFSET + q_hi) of each word's nibbles at bits 0-3 and 16-19, bf16 for EXP
    0x4300, else fp16: on the GPU one lop3 makes both 16-bit numbers ((w & 0x000F000F) |
    EXP EXP) and a register move splits them; elsewhere (the interpreter) each half is masked
    and bitcast."""
    dtype = tl.bfloat16 if EXP == 0x4300 else tl.float16
    if ASM:
        exp2 = tl.full(shifted.shape, EXP | (EXP << 16), tl.int32)
        lo, hi = tl.inline_asm_elementwise(
            "{\n.reg .b32 t;\nlop3.b32 t, $2, 0x000F000F, $3, 0xEA;\nmov.b32 {$0, $1}, t;\n}",
            "=h,=h,r,r",
            [shifted, exp2],
            dtype=(dtype, dtype),
            is_pure=True,
            pack=1,
        )
    else:
        lo = ((shifted & 0xF) | EXP).to(tl.int16).to(dtype, bitcast=True)
        hi = (((shifted >> 16) & 0xF) | EXP).to(tl.int16).to(dtype, bitcast=True)
    return lo, hi


@triton.jit
def _nibble_pair_dot(acc_lo, acc_hi, x, xs, words, s_lo, z_lo, s_hi, z_hi, J: tl.constexpr,
                     EXP: tl.constexpr, OFFSET: tl.constexpr, IEEE: tl.constexpr,
                     ASM: tl.constexpr):  # fmt: skip
    """Nibbles J and J + 4 of the words (the columns 8c + J and 8c + J + 4, [16, BLOCK_N / 8]
    each) into their accumulators."""
    if IEEE:  # fp32 (the interpreter): q as fp32, OFFSET 0
        w_lo = ((words >> (4 * J)) & 0xF).to(tl.float32)
        w_hi = ((words >> (4 * J + 16)) & 0xF).to(tl.float32)
        d_lo = tl.dot(x, w_lo, input_precision="ieee")
        d_hi = tl.dot(x, w_hi, input_precision="ieee")
    else:
        w_lo, w_hi = _offset_pair(words >> (4 * J), EXP, ASM)
        d_lo = tl.dot(x, w_lo)
        d_hi = tl.dot(x, w_hi)
    acc_lo = _scaled(acc_lo, d_lo, xs, s_lo, z_lo, OFFSET)
    acc_hi = _scaled(acc_hi, d_hi, xs, s_hi, z_hi, OFFSET)
    return acc_lo, acc_hi


@triton.jit
def _x_tile(X, offs_m, M, stride_xm, offs_k, k_end):
    """x [16, BLOCK_K] at columns offs_k, zeros past M and k_end."""
    mask = (offs_m[:, None] < M) & (offs_k < k_end)[None, :]
    return tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)


@triton.jit
def _tile(a0, a1, a2, a3, a4, a5, a6, a7, x, words, sz, EXP: tl.constexpr, OFFSET: tl.constexpr,
          IEEE: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """One K tile into the eight accumulators (nibble j: columns 8c + j); sz: _group_rows'."""
    xs = tl.sum(x.to(tl.float32), axis=1)
    a0, a4 = _nibble_pair_dot(a0, a4, x, xs, words, sz[0], sz[8], sz[4], sz[12], 0, EXP, OFFSET,
                              IEEE, ASM)  # fmt: skip
    a1, a5 = _nibble_pair_dot(a1, a5, x, xs, words, sz[1], sz[9], sz[5], sz[13], 1, EXP, OFFSET,
                              IEEE, ASM)  # fmt: skip
    a2, a6 = _nibble_pair_dot(a2, a6, x, xs, words, sz[2], sz[10], sz[6], sz[14], 2, EXP, OFFSET,
                              IEEE, ASM)  # fmt: skip
    a3, a7 = _nibble_pair_dot(a3, a7, x, xs, words, sz[3], sz[11], sz[7], sz[15], 3, EXP, OFFSET,
                              IEEE, ASM)  # fmt: skip
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _finish(acc, up, J: tl.constexpr, Y, WS, Counters, arrived, M, N, offs_m, offs_c, in_c,
            stride_ym, pid_k, SPLIT_K: tl.constexpr, SWIGLU: tl.constexpr):  # fmt: skip
    """Nibble J's columns of y (SPLIT_K == 1), or of this slice's plane (arrived < 0) or, for
    the slice that arrived last, of y from every plane."""
    cols = offs_c * 8 + J
    mask = (offs_m[:, None] < M) & in_c[None, :]
    out = Y + offs_m[:, None] * stride_ym + cols[None, :]
    dtype = Y.dtype.element_ty
    ws_n = 2 * N if SWIGLU else N
    plane_stride = M * ws_n
    plane_offs = offs_m[:, None] * ws_n + cols[None, :]
    if SPLIT_K == 1:
        _write_y(acc, up, out, mask, acc, dtype, SWIGLU, False)
    elif arrived < 0:
        tl.store(WS + pid_k * plane_stride + plane_offs, acc, mask=mask)
        if SWIGLU:
            tl.store(WS + pid_k * plane_stride + plane_offs + N, up, mask=mask)
    elif arrived == SPLIT_K - 1:
        total = _sum_planes(WS, plane_offs, mask, plane_stride, SPLIT_K)
        total_up = total
        if SWIGLU:
            total_up = _sum_planes(WS, plane_offs + N, mask, plane_stride, SPLIT_K)
        _write_y(total, total_up, out, mask, total, dtype, SWIGLU, False)


@triton.jit
def _finish_nibbles(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, Y, WS,
                    Counters, arrived, M, N, offs_m, offs_c, in_c, stride_ym, pid_k,
                    SPLIT_K: tl.constexpr, SWIGLU: tl.constexpr):  # fmt: skip
    """`_finish` of the eight nibble positions' sums (a: gate or the plain output, b: up)."""
    args = (Y, WS, Counters, arrived, M, N, offs_m, offs_c, in_c, stride_ym, pid_k)
    _finish(a0, b0, 0, *args, SPLIT_K, SWIGLU)
    _finish(a1, b1, 1, *args, SPLIT_K, SWIGLU)
    _finish(a2, b2, 2, *args, SPLIT_K, SWIGLU)
    _finish(a3, b3, 3, *args, SPLIT_K, SWIGLU)
    _finish(a4, b4, 4, *args, SPLIT_K, SWIGLU)
    _finish(a5, b5, 5, *args, SPLIT_K, SWIGLU)
    _finish(a6, b6, 6, *args, SPLIT_K, SWIGLU)
    _finish(a7, b7, 7, *args, SPLIT_K, SWIGLU)


@triton.jit
def _int4_gemv_kernel(
    X,
    QW,
    S,
    Z,
    Y,
    WS,
    Counters,
    M,
    N,  # output columns (swiglu: of each half)
    K,
    k_per_split,
    group_size,
    stride_xm,
    stride_ym,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SWIGLU: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    EXP: tl.constexpr,
    OFFSET: tl.constexpr,
    IEEE: tl.constexpr,
    ASM: tl.constexpr,  # inline PTX: on the GPU, not the interpreter
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    NW: tl.constexpr = BLOCK_N // 8
    n_rows = 2 * N if SWIGLU else N  # the packed weight's columns
    n_words = n_rows // 8
    offs_m = tl.arange(0, 16)
    offs_c = pid_n * NW + tl.arange(0, NW)  # word columns of this program (gate half)
    in_c = offs_c < N // 8
    up_c = offs_c + N // 8  # SWIGLU: the up half's words
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)

    # before the PDL wait (the weights are no earlier kernel's output): the slice's first two
    # word tiles and its scale and zero rows into L2, so the loop's first loads do not wait on
    # HBM
    _prefetch_tiles(QW, k_start, k_end, pid_n * NW, n_words, BLOCK_K, ASM)
    _prefetch_scales(S, Z, k_start, k_end, group_size, n_rows, pid_n * BLOCK_N, BLOCK_N, HAS_ZEROS,
                     ASM)  # fmt: skip
    if SWIGLU:
        _prefetch_tiles(QW, k_start, k_end, pid_n * NW + N // 8, n_words, BLOCK_K, ASM)
        _prefetch_scales(S, Z, k_start, k_end, group_size, n_rows, pid_n * BLOCK_N + N, BLOCK_N,
                         HAS_ZEROS, ASM)  # fmt: skip
    pdl_wait(PDL)
    zero = tl.zeros([16, NW], dtype=tl.float32)
    a0, a1, a2, a3, a4, a5, a6, a7 = zero, zero, zero, zero, zero, zero, zero, zero
    b0, b1, b2, b3, b4, b5, b6, b7 = zero, zero, zero, zero, zero, zero, zero, zero
    # the word and x tiles stream through shared memory, num_stages - 1 tiles ahead (Triton's
    # pipeliner, asynchronous copies); each word tile is read into the dot's operand layout once
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = _x_tile(X, offs_m, M, stride_xm, offs_k, k_end)
        words = _words(QW, offs_k, k_end, offs_c, in_c, n_words)
        sz = _group_rows(S, Z, k0, group_size, n_rows, offs_c, in_c, HAS_ZEROS)
        a0, a1, a2, a3, a4, a5, a6, a7 = _tile(
            a0, a1, a2, a3, a4, a5, a6, a7, x, words, sz, EXP, OFFSET, IEEE, ASM
        )
        if SWIGLU:
            u = _words(QW, offs_k, k_end, up_c, in_c, n_words)
            szu = _group_rows(S, Z, k0, group_size, n_rows, up_c, in_c, HAS_ZEROS)
            b0, b1, b2, b3, b4, b5, b6, b7 = _tile(
                b0, b1, b2, b3, b4, b5, b6, b7, x, u, szu, EXP, OFFSET, IEEE, ASM
            )

    sums = (a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, Y, WS, Counters)
    where = (M, N, offs_m, offs_c, in_c, stride_ym, pid_k)
    arrived = -1
    if SPLIT_K > 1:  # this slice's planes first
        _finish_nibbles(*sums, arrived, *where, SPLIT_K, SWIGLU)
        # NOTE: every thread's stores before the one release (as kernels/gemv.py): bar.sync,
        # then a gpu-scope acq_rel atomic; the last slice's acquire sees every plane
        tl.debug_barrier()
        arrived = tl.atomic_add(Counters + pid_n, 1, sem="acq_rel", scope="gpu")
    _finish_nibbles(*sums, arrived, *where, SPLIT_K, SWIGLU)
    if SPLIT_K > 1:
        if arrived == SPLIT_K - 1:
            tl.atomic_xchg(Counters + pid_n, 0, sem="relaxed", scope="gpu")  # for the next call


@triton.jit
def _one_plus_q16(words, J: tl.constexpr, ASM: tl.constexpr):
    """1 + q / 16 as fp32 (exact) for nibble J of each word: the nibble shifted into the top
    four mantissa bits of 1.0, then (w & 0x00780000) | 0x3F800000, one lop3 on the GPU (inline
    PTX, the exponent a register: a lop3 takes one immediate; as two constants ptxas makes
    two)."""
    if J <= 4:
        t = words << (19 - 4 * J)
    else:
        t = words >> (4 * J - 19)  # the bits kept come from the word, not its sign
    if ASM:
        exp_one = tl.full(t.shape, 0x3F800000, tl.int32)
        return tl.inline_asm_elementwise(
            "lop3.b32 $0, $1, 0x00780000, $2, 0xEA;",
            "=r,r,r",
            [t, exp_one],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    return ((t & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _fma_row(p0, p1, p2, p3, p4, p5, p6, p7, words, x, ASM: tl.constexpr):
    """One K row's eight nibbles into their partial sums: p_j + x * (1 + q_j / 16), a shift, a
    lop3 and an FMA each (the row's x times the nibble, added, contracts to one FMA)."""
    p0 += x * _one_plus_q16(words, 0, ASM)
    p1 += x * _one_plus_q16(words, 1, ASM)
    p2 += x * _one_plus_q16(words, 2, ASM)
    p3 += x * _one_plus_q16(words, 3, ASM)
    p4 += x * _one_plus_q16(words, 4, ASM)
    p5 += x * _one_plus_q16(words, 5, ASM)
    p6 += x * _one_plus_q16(words, 6, ASM)
    p7 += x * _one_plus_q16(words, 7, ASM)
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def _fma_scaled(acc, part, xs, S, Z, sz_offs, mask_sz, J: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """acc plus a tile's partial sums of the columns 8w + J with their scale and zero applied:

        sum_k x[k] s (q - z) = s (16 sum_k x[k] (1 + q / 16) - (16 + z) sum_k x[k])

    xs: sum_k x[k] over the thread's rows of the tile."""
    s, z = _sz(S, Z, sz_offs, J, mask_sz, HAS_ZEROS)
    return acc + (16.0 * s) * part - (s * (16.0 + z)) * xs


@triton.jit
def _fma_tile_sums(a0, a1, a2, a3, a4, a5, a6, a7, base, xb, k0, k_end, rows, in_w,
                   n_words: tl.constexpr, S, Z, sz_offs, mask_sz, R: tl.constexpr,
                   WARPS: tl.constexpr, EVEN: tl.constexpr, HAS_ZEROS: tl.constexpr,
                   ASM: tl.constexpr):  # fmt: skip
    """The accumulators plus one [BLOCK_K, 256] tile (base: its first row's words, xb: its x):
    the thread's R rows r * WARPS + v unrolled, each a word load, an x load and eight FMAs, then
    the tile's scales and zeros once (a tile lies inside one group)."""
    zero = tl.zeros(a0.shape, dtype=tl.float32)
    p0, p1, p2, p3, p4, p5, p6, p7 = zero, zero, zero, zero, zero, zero, zero, zero
    xs = zero
    for r in tl.static_range(R):
        if EVEN:
            words = tl.load(base + r * WARPS * n_words)
            x = tl.load(xb + r * WARPS).to(tl.float32)
        else:
            in_k = k0 + r * WARPS + rows < k_end
            words = tl.load(base + r * WARPS * n_words, mask=in_k & in_w, other=0)
            x = tl.load(xb + r * WARPS, mask=in_k, other=0.0).to(tl.float32)
        xs += x
        p0, p1, p2, p3, p4, p5, p6, p7 = _fma_row(p0, p1, p2, p3, p4, p5, p6, p7, words, x, ASM)
    a0 = _fma_scaled(a0, p0, xs, S, Z, sz_offs, mask_sz, 0, HAS_ZEROS)
    a1 = _fma_scaled(a1, p1, xs, S, Z, sz_offs, mask_sz, 1, HAS_ZEROS)
    a2 = _fma_scaled(a2, p2, xs, S, Z, sz_offs, mask_sz, 2, HAS_ZEROS)
    a3 = _fma_scaled(a3, p3, xs, S, Z, sz_offs, mask_sz, 3, HAS_ZEROS)
    a4 = _fma_scaled(a4, p4, xs, S, Z, sz_offs, mask_sz, 4, HAS_ZEROS)
    a5 = _fma_scaled(a5, p5, xs, S, Z, sz_offs, mask_sz, 5, HAS_ZEROS)
    a6 = _fma_scaled(a6, p6, xs, S, Z, sz_offs, mask_sz, 6, HAS_ZEROS)
    a7 = _fma_scaled(a7, p7, xs, S, Z, sz_offs, mask_sz, 7, HAS_ZEROS)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _fma_plane_store(WS, a0, a1, a2, a3, a4, a5, a6, a7, offs):
    """A program's sums of its 256 columns to its plane, nibble-major: column 8w + j at
    j * 32 + w (offs: the plane's w = 0 .. 31), 128 contiguous bytes a nibble."""
    tl.store(WS + offs, a0)
    tl.store(WS + offs + 32, a1)
    tl.store(WS + offs + 64, a2)
    tl.store(WS + offs + 96, a3)
    tl.store(WS + offs + 128, a4)
    tl.store(WS + offs + 160, a5)
    tl.store(WS + offs + 192, a6)
    tl.store(WS + offs + 224, a7)


@triton.jit
def _fma_write(Y, a, up, j, w, pid_n, N, SWIGLU: tl.constexpr):
    """y's columns 8 (32 pid_n + w) + j from their fp32 sums (and the up half's)."""
    cols = (pid_n * 32 + w) * 8 + j
    _write_y(a, up, Y + cols, cols < N, a, Y.dtype.element_ty, SWIGLU, False)


@triton.jit
def _fma_planes_sum(WS, first, plane, SPLIT_K: tl.constexpr, SPLIT_P2: tl.constexpr):
    """The 256 sums of a column tile over every K slice's plane (first: the tile's offset in
    the first plane), one [SPLIT_P2, 256] load from L2 (`.cg`: the other slices' stores are
    there, this SM's L1 may hold an earlier call's) and a fixed-order sum: deterministic."""
    ks = tl.arange(0, SPLIT_P2)[:, None]
    offs = ks * plane + first + tl.arange(0, 256)[None, :]
    parts = tl.load(WS + offs, mask=ks < SPLIT_K, other=0.0, cache_modifier=".cg")
    return tl.sum(parts, axis=0)


@triton.jit(do_not_specialize=["one"])
def _int4_gemv_fma_kernel(
    X,
    QW,
    S,
    Z,
    Y,
    WS,
    Counters,
    N: tl.constexpr,  # output columns (swiglu: of each half); a constant: row offsets immediate
    K,
    k_per_split,
    group_size,
    one,  # 1, not specialized: the word columns' stride (see below)
    R: tl.constexpr,  # rows a thread a tile
    WARPS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SPLIT_P2: tl.constexpr,  # SPLIT_K's next power of two
    EVEN: tl.constexpr,  # no masks: whole column tiles, K slices of whole tiles
    SWIGLU: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    ASM: tl.constexpr,
    PDL: tl.constexpr,
):
    """x [1, K] @ W^T on the CUDA cores. A program owns 32 word columns (256 output columns)
    and a K slice, in tiles of R * WARPS rows: lane i of warp v holds word column i of the
    rows r * WARPS + v (r = 0 .. R - 1, unrolled: R independent word loads a thread in flight),
    so the sums over K stay inside each thread, one FMA a weight value, and the warps meet once,
    after the loop. The columns' stride `one` is a runtime 1: knowing no contiguity, Triton
    lays a warp's threads along the columns, one word a thread (a warp reads a 128-byte row).
    Split-K: each slice stores its 256 sums to its plane, the slice that arrives last sums the
    planes (one load of all of them) and writes y."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    W: tl.constexpr = 32
    BLOCK_K: tl.constexpr = R * WARPS
    n_rows: tl.constexpr = 2 * N if SWIGLU else N
    n_words: tl.constexpr = n_rows // 8
    offs_w = pid_n * W + tl.arange(0, W)
    in_w = (offs_w < N // 8)[:, None]  # [W, 1]
    cols = (offs_w * one)[:, None]  # [W, 1]
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    rows = tl.arange(0, WARPS)[None, :] * one  # [1, WARPS]: warp v's row of each row group
    w_offs = rows * n_words + cols  # [W, WARPS]: the tile's first row group's words
    x_offs = rows + cols * 0  # each thread's x (the same address across a warp)
    sz_cols = cols * 8 + rows * 0  # [W, WARPS]: the columns' scale offsets in a group row
    mask_sz = in_w & (rows >= 0)
    up = (N // 8) * one

    _prefetch_tiles(QW, k_start, k_end, pid_n * W, n_words, BLOCK_K, ASM)
    _prefetch_scales(S, Z, k_start, k_end, group_size, n_rows, pid_n * W * 8, W * 8, HAS_ZEROS,
                     ASM)  # fmt: skip
    if SWIGLU:
        _prefetch_tiles(QW, k_start, k_end, pid_n * W + N // 8, n_words, BLOCK_K, ASM)
        _prefetch_scales(S, Z, k_start, k_end, group_size, n_rows, pid_n * W * 8 + N, W * 8,
                         HAS_ZEROS, ASM)  # fmt: skip
    pdl_wait(PDL)
    zero = tl.zeros([W, WARPS], dtype=tl.float32)
    a0, a1, a2, a3, a4, a5, a6, a7 = zero, zero, zero, zero, zero, zero, zero, zero
    b0, b1, b2, b3, b4, b5, b6, b7 = zero, zero, zero, zero, zero, zero, zero, zero
    for k0 in range(k_start, k_end, BLOCK_K):
        base = QW + tl.cast(k0, tl.int64) * n_words + w_offs
        xb = X + k0 + x_offs
        sz_offs = tl.cast(k0 // group_size, tl.int64) * n_rows + sz_cols
        a0, a1, a2, a3, a4, a5, a6, a7 = _fma_tile_sums(
            a0, a1, a2, a3, a4, a5, a6, a7, base, xb, k0, k_end, rows, in_w, n_words, S, Z,
            sz_offs, mask_sz, R, WARPS, EVEN, HAS_ZEROS, ASM,
        )  # fmt: skip
        if SWIGLU:
            b0, b1, b2, b3, b4, b5, b6, b7 = _fma_tile_sums(
                b0, b1, b2, b3, b4, b5, b6, b7, base + up, xb, k0, k_end, rows, in_w, n_words,
                S, Z, sz_offs + N, mask_sz, R, WARPS, EVEN, HAS_ZEROS, ASM,
            )  # fmt: skip

    # the warps' sums (the one exchange between threads): [W] each
    a0, a1, a2, a3 = tl.sum(a0, axis=1), tl.sum(a1, axis=1), tl.sum(a2, axis=1), tl.sum(a3, axis=1)
    a4, a5, a6, a7 = tl.sum(a4, axis=1), tl.sum(a5, axis=1), tl.sum(a6, axis=1), tl.sum(a7, axis=1)
    if SWIGLU:
        b0, b1, b2, b3 = tl.sum(b0, 1), tl.sum(b1, 1), tl.sum(b2, 1), tl.sum(b3, 1)
        b4, b5, b6, b7 = tl.sum(b4, 1), tl.sum(b5, 1), tl.sum(b6, 1), tl.sum(b7, 1)
    else:
        b0, b1, b2, b3, b4, b5, b6, b7 = a0, a1, a2, a3, a4, a5, a6, a7
    w = tl.arange(0, W)
    if SPLIT_K == 1:
        _fma_write(Y, a0, b0, 0, w, pid_n, N, SWIGLU)
        _fma_write(Y, a1, b1, 1, w, pid_n, N, SWIGLU)
        _fma_write(Y, a2, b2, 2, w, pid_n, N, SWIGLU)
        _fma_write(Y, a3, b3, 3, w, pid_n, N, SWIGLU)
        _fma_write(Y, a4, b4, 4, w, pid_n, N, SWIGLU)
        _fma_write(Y, a5, b5, 5, w, pid_n, N, SWIGLU)
        _fma_write(Y, a6, b6, 6, w, pid_n, N, SWIGLU)
        _fma_write(Y, a7, b7, 7, w, pid_n, N, SWIGLU)
    else:
        # planes [SPLIT_K, tiles * 256] (swiglu: the up half's after them, as many)
        plane = tl.num_programs(0) * 256
        first = pid_n * 256
        _fma_plane_store(WS + pid_k * plane + first, a0, a1, a2, a3, a4, a5, a6, a7, w)
        if SWIGLU:
            _fma_plane_store(WS + (SPLIT_K + pid_k) * plane + first, b0, b1, b2, b3, b4, b5,
                             b6, b7, w)  # fmt: skip
        # NOTE: every thread's stores before the one release (as kernels/gemv.py): bar.sync,
        # then a gpu-scope acq_rel atomic; the last slice's acquire sees every plane
        tl.debug_barrier()
        arrived = tl.atomic_add(Counters + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = _fma_planes_sum(WS, first, plane, SPLIT_K, SPLIT_P2)
            total_up = total
            if SWIGLU:
                total_up = _fma_planes_sum(WS, SPLIT_K * plane + first, plane, SPLIT_K, SPLIT_P2)
            idx = tl.arange(0, 256)  # nibble-major: column 8 (idx % 32) + idx // 32
            _fma_write(Y, total, total_up, idx // 32, idx % 32, pid_n, N, SWIGLU)
            tl.atomic_xchg(Counters + pid_n, 0, sem="relaxed", scope="gpu")  # for the next call


# NOTE: K-split programs aimed at: about two per SM of the H200 (132 SMs), for matrices of at
# most SPLIT_MAX_TILES column tiles; a slice keeps at least two K tiles (the prefetch's depth)
TARGET_PROGRAMS = 256
SPLIT_MAX_TILES = 128
MAX_SPLIT_K = 16
# M = 1: the CUDA-core kernel, 256 columns x 128 rows (a group of 128) a tile on 4 warps, in K
# slices of at least one tile until there are about FMA_TARGET_PROGRAMS programs. On one H100
# (bench_int4_matmul.py --m 1 --sweep fma: 128 x 4, 128 x 8 and 64 x 4 tiles a split of 1 to
# 64) this rule's pick is the fastest for qkv and the SwiGLU gate_up, and ties a 64-row tiling on o
FMA_CONFIG = Int4GemvConfig(block_n=256, block_k=128, num_warps=4, num_stages=1, fma=True)
FMA_TARGET_PROGRAMS = 768
FMA_MAX_SPLIT_K = 32


def pick_config(m: int, n: int, k: int, swiglu: bool = False) -> Int4GemvConfig:
    """One row: the CUDA-core kernel (pick_fma_config); more: the tensor-core kernel
    (pick_dot_config)."""
    if m == 1:
        return pick_fma_config(n, k, swiglu)
    return pick_dot_config(m, n, k, swiglu)


def pick_dot_config(m: int, n: int, k: int, swiglu: bool = False) -> Int4GemvConfig:
    """The tensor-core kernel's config: 256 columns x 64-deep K tiles a program, 4 warps (with
    swiglu 256 columns of each half x 32-deep tiles: the same bytes a step); matrices of few
    column tiles split along K until there are about TARGET_PROGRAMS programs (a power of two,
    at most MAX_SPLIT_K slices of at least two tiles). llama-8b at M = 16: qkv (24 tiles) in 8
    slices, o_proj and down_proj (16) in 16, gate_up (56 tiles a half) in 4.

    Compiled for sm_90 under Triton 3.6 (scripts/check_kernels_compile.py --ptxas --sass), the
    plain config takes 178 registers a thread at M = 16 (two programs an SM) and its loop 4.9
    instructions a weight element a thread; swiglu's 255 registers and 6.3 (both halves' scale
    loads and epilogues a 32-deep tile; 44 bytes spilled where K splits in 16, as a narrow
    gate_up's does, none at llama-8b's 4). 128-deep plain tiles take 4.3 instructions an
    element but 224 registers (two programs an SM). `scripts/bench_int4_matmul.py --sweep`
    times the alternatives on the GPU."""
    cfg = Int4GemvConfig(block_k=32) if swiglu else Int4GemvConfig()
    return _split(cfg, n, k, swiglu, TARGET_PROGRAMS, MAX_SPLIT_K, 2)


def pick_fma_config(n: int, k: int, swiglu: bool = False) -> Int4GemvConfig:
    """The CUDA-core kernel's config for x [1, K] (FMA_CONFIG, split along K by the rule of
    pick_dot_config with FMA_TARGET_PROGRAMS, slices of at least one tile). llama-8b: qkv (24
    column tiles) in 32 slices, o and down (16) in 32, the SwiGLU gate_up (56 a half) in 8."""
    return _split(FMA_CONFIG, n, k, swiglu, FMA_TARGET_PROGRAMS, FMA_MAX_SPLIT_K, 1)


def _split(cfg: Int4GemvConfig, n: int, k: int, swiglu: bool, target: int, max_split: int,
           min_tiles: int) -> Int4GemvConfig:  # fmt: skip
    """cfg split along K (powers of two, slices of at least min_tiles K tiles) until there are
    about `target` programs, for matrices of at most SPLIT_MAX_TILES column tiles."""
    n_out = n // 2 if swiglu else n
    tiles = triton.cdiv(n_out, cfg.block_n)
    split_k = 1
    while (
        tiles <= SPLIT_MAX_TILES
        and split_k < max_split
        and tiles * split_k * 2 <= target
        and k >= 2 * min_tiles * split_k * cfg.block_k
    ):
        split_k *= 2
    return cfg._replace(split_k=split_k)


def int4_gemv(
    x: torch.Tensor,  # [M, K], M <= 16, unit stride along K; bf16 / fp16 (fp32: interpreter)
    w: Int4Packed,  # groups None (`takes`); swiglu: the fused [2I] gate_up columns
    config: Int4GemvConfig | None = None,
    swiglu: bool = False,
    *,
    pdl: bool = False,  # launched with programmatic dependent launch (kernels/pdl.py)
) -> torch.Tensor:
    """x @ W^T: [M, N] in x's dtype; with swiglu, silu(x @ W_gate^T) * (x @ W_up^T): [M, N / 2],
    gate and up rounded to the dtype first, as the unfused path rounds them."""
    m, k = x.shape
    n_rows = w.out_features
    assert k == w.in_features and x.stride(1) == 1, (x.shape, x.stride(), w.in_features)
    assert takes(w, m, swiglu), (m, n_rows, w.perm is None, w.groups is None, swiglu)
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    n = n_rows // 2 if swiglu else n_rows
    cfg = config or pick_config(m, n_rows, k, swiglu)
    assert cfg.block_n >= 128, cfg  # tl.dot's N (block_n / 8 columns a nibble) is at least 16
    block_k = cfg.block_k
    if w.group_size < k:  # a K tile inside one group (group sizes are multiples of 16)
        while w.group_size % block_k:
            block_k //= 2
    if x.dtype == torch.float32:
        block_k = min(block_k, 64)
    exp_bits, offset = EXP_BITS.get(x.dtype, (0, 0.0))
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    tiles = triton.cdiv(n, cfg.block_n)
    if tiles > NUM_COUNTERS:
        split_k, k_per_split = 1, k
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    counters = split_counters(x.device) if split_k > 1 else y
    if cfg.fma:
        assert m == 1 and cfg.block_n == 256 and block_k % cfg.num_warps == 0, (m, cfg, block_k)
        even = n % 256 == 0 and k % k_per_split == 0  # (k_per_split: whole K tiles)
        planes = split_k * tiles * 256 * (2 if swiglu else 1)
        ws = y if split_k == 1 else torch.empty(planes, dtype=torch.float32, device=x.device)
        _int4_gemv_fma_kernel[(tiles, split_k)](
            x, w.qweight, w.scales, y if w.zeros is None else w.zeros, y, ws, counters,
            n, k, k_per_split, w.group_size, 1,
            R=block_k // cfg.num_warps, WARPS=cfg.num_warps, SPLIT_K=split_k,
            SPLIT_P2=triton.next_power_of_2(split_k), EVEN=even, SWIGLU=swiglu,
            HAS_ZEROS=w.zeros is not None, ASM=x.is_cuda, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **pdl_launch_kwargs(pdl, x),
        )  # fmt: skip
        return y
    ws = y if split_k == 1 else torch.empty(split_k * m * n_rows, dtype=torch.float32,
                                            device=x.device)  # fmt: skip
    # NOTE: absent operands get y as a stand-in pointer: their constexpr flag prunes every access
    _int4_gemv_kernel[(tiles, split_k)](
        x, w.qweight, w.scales, y if w.zeros is None else w.zeros, y, ws, counters,
        m, n, k, k_per_split, w.group_size, x.stride(0), y.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_K=block_k, SPLIT_K=split_k, SWIGLU=swiglu,
        HAS_ZEROS=w.zeros is not None, EXP=exp_bits,
        OFFSET=offset, IEEE=x.dtype == torch.float32, ASM=x.is_cuda, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_launch_kwargs(pdl, x),
    )  # fmt: skip
    return y
