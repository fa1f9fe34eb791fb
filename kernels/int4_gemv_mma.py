"""W4A16 decode matmul on the tensor cores without a layout round trip: y[M, N] = x[M, K] @ W^T
for M <= 16, written in Gluon (Triton's explicit-layout dialect, `triton.experimental.gluon`),
over a weight repacked at load for it (`Int4MmaPacked`, batchrun/quant/int4_layout.py's
mma_pack). The decode matmul (M <= 16) of the engine's INT4 layers where it takes the weight
(batchrun/quant/linear.py keeps such a weight in this order only; kernels/int4_matmul.py reads
it for the other batches).

The weight is the A operand of mma.m16n8k16 (16 output rows a warp; bf16 or fp16), x the B
operand (its M rows padded to 8 or 16 columns). mma_pack orders the 4-bit values so that one
16-byte load a thread holds exactly its A fragments for four 16-deep k-blocks: a 64-deep K
step is one LDG.128 a thread. Each word's nibbles become the numbers OFFSET + q (128 for bf16,
1024 for fp16, exact) in pairs, one lop3 a pair (inline PTX), and the pairs joined, reshaped
and permuted are already the operand's registers: `gl.convert_layout(..., assert_trivial=True)`
proves it at compile time (no shared memory). The zero point and scale apply once a chunk of K
(inside one group), after the dot:

    sum_k (q - z) * s * x[k] = s * (sum_k (OFFSET + q) x[k] - (OFFSET + z) * sum_k x[k])

with sum_k x[k] from a second MMA whose A operand is all ones (it lands in the accumulator's
layout). x's step is loaded the same way: K is permuted inside each 64-deep step (mma_pack's
order) so that a thread's B fragments are 16 contiguous values of x, two 16-byte loads a row.
Compiled for sm_90 with Triton 3.6 (scripts/check_kernels_compile.py --ptxas --sass), one row,
group 128: a 128-deep chunk is 189 instructions a thread (2.95 a weight value): 2 LDG.128 of
weights, 3 shifts and 4 lop3 a word, 16 MMAs (half of them for sum x), no shared memory, 40
registers. Its times against bf16 cuBLAS: docs/benchmarks.md, Quantized models.

Split-K reduces in the kernel, deterministically: each K slice stores its fp32 sums to its
plane of a [SPLIT_K, M, N] workspace ([SPLIT_K, M, 2N] with swiglu), the slice that arrives last
(kernels/gemv.py's counters) sums the planes in slice order and writes y.

Gluon has no CPU interpreter: this kernel is checked by compiling it here and by
tests/gpu/test_int4_kernel_gpu.py on the GPU; mma_pack's order is checked on the CPU
(tests/unit/test_int4_layout.py) against the index map the kernel's reshapes encode.

    wm = mma_pack(packed)                       # once, at load
    y = int4_gemv_mma(x, wm)                    # x [M <= 16, K]
    a = int4_gemv_mma(x, wm_gate_up, swiglu=True)
"""

from __future__ import annotations

import torch
import triton
from batchrun.kernels.gemv import NUM_COUNTERS, SplitRule, split_counters, split_k_for
from batchrun.kernels.pdl import pdl_launch_kwargs
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from batchrun.quant.int4_layout import MMA_K, MMA_ROWS, Int4MmaPacked

# the CTA barrier: gl.thread_barrier in Triton 3.6 (the GPU machine's), gl.barrier from 3.7
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

MAX_M = 16
WARPS = 4
ROWS = MMA_ROWS * WARPS  # output rows a program: 16 a warp
# OFFSET + q as the 16-bit float of each nibble: the low 16 bits OR-ed onto a nibble make the
# bf16 / fp16 number OFFSET + q (OFFSET: its ulp is 1); in both halves of a word, and OFFSET
HALF_EXP_BITS = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}
EXP_BITS = {dtype: (bits << 16 | bits, offset) for dtype, (bits, offset) in HALF_EXP_BITS.items()}
# NOTE: K-split programs at most (about 12 an SM of 132); a slice keeps at least two chunks:
# the split that is fastest for each of llama-8b's matrices (docs/benchmarks.md, Quantized
# models)
SPLIT = SplitRule(target_programs=1536, max_split=32, min_tiles=2)


@gluon.jit
def _pair(words, SHIFT: gl.constexpr, EXP: gl.constexpr, DTYPE: gl.constexpr):
    """Nibbles SHIFT / 4 and SHIFT / 4 + 4 of each word as the 16-bit floats OFFSET + q: one
    lop3 ((w >> SHIFT) & 0x000F000F | EXP), its halves split (a register move, no instruction)."""
    w = words >> SHIFT if SHIFT > 0 else words
    return gl.inline_asm_elementwise(
        "{ .reg .b32 t; lop3.b32 t, $2, 0x000F000F, $3, 0xEA; mov.b32 {$0, $1}, t; }",
        "=h,=h,r,r",
        [w, gl.full(w.shape, EXP, gl.int32, layout=w.type.layout)],
        dtype=(DTYPE.value, DTYPE.value),
        is_pure=True,
        pack=1,
    )


@gluon.jit
def _a_operand(words, R2: gl.constexpr, EXP: gl.constexpr, DTYPE: gl.constexpr,
               A_LAYOUT: gl.constexpr):  # fmt: skip
    """The A operand [2 R2, 64] (OFFSET + q) of a 64-deep step from its words [R2, 4, 4].

    Word (r', m, b) of a thread (r' its row pair, m = lane % 4, b its k-block) holds nibble
    p = 4 b_k1 + 2 b_k8 + b_r8 of row 16 (r' // 8) + 8 b_r8 + r' % 8, column
    16 b + 8 b_k8 + 2 m + b_k1 (mma_pack). Pair i = (nibble i, nibble i + 4) is (b_k1 = 0, 1)
    at b_r8 = i % 2, b_k8 = i // 2: the joins build [R2, m, b, b_k1, b_r8, b_k8], the reshape
    and permute [rows, 64], whose layout is the operand's register for register."""
    lo0, hi0 = _pair(words, 0, EXP, DTYPE)
    lo1, hi1 = _pair(words, 4, EXP, DTYPE)
    lo2, hi2 = _pair(words, 8, EXP, DTYPE)
    lo3, hi3 = _pair(words, 12, EXP, DTYPE)
    lo = gl.join(gl.join(lo0, hi0), gl.join(lo1, hi1))
    hi = gl.join(gl.join(lo2, hi2), gl.join(lo3, hi3))
    q = gl.join(lo, hi)  # [R2, 4, 4, 2 (b_k1), 2 (b_r8), 2 (b_k8)]
    q = gl.reshape(q, [R2 // 8, 8, 4, 4, 2, 2, 2])
    q = gl.permute(q, (0, 5, 1, 3, 6, 2, 4))  # [R2 / 8, b_r8, r' % 8, b, b_k8, m, b_k1]
    a = gl.reshape(q, [2 * R2, 64])
    return gl.convert_layout(a, A_LAYOUT, assert_trivial=True)


@gluon.jit
def _step(QW, step, row_pair0, N_PAIRS: gl.constexpr, w_offs):
    """A 64-deep step's words [R2, 4, 4] (one 16-byte load a thread)."""
    return gl.load(QW + step.to(gl.int64) * (N_PAIRS * 16) + row_pair0 * 16 + w_offs)


@gluon.jit
def _b_operand(X, step, x_offs, x_mask, MP: gl.constexpr, B_LAYOUT: gl.constexpr):
    """x's step as the B operand [64, MP]: each thread's 16 contiguous values of its row (two
    16-byte loads; x_offs [MP, 4, 16]), the MMA's column 16 b + 8 b_8 + 2 m + b_1 being K row
    16 m + 4 b + 2 b_8 + b_1 of the step (mma_pack's permutation)."""
    xt = gl.load(X + step * 64 + x_offs, mask=x_mask, other=0.0)  # [MP, m, 16]
    xt = gl.reshape(xt, [MP, 4, 4, 2, 2])  # t m b b_8 b_1
    xt = gl.permute(xt, (2, 3, 1, 4, 0))  # b b_8 m b_1 t
    return gl.convert_layout(gl.reshape(xt, [64, MP]), B_LAYOUT, assert_trivial=True)


@gluon.jit
def _mma_step(words, X, step, x_offs, x_mask, ones, acc, accx, R2: gl.constexpr,
              MP: gl.constexpr, EXP: gl.constexpr, DTYPE: gl.constexpr, A_LAYOUT: gl.constexpr,
              B_LAYOUT: gl.constexpr):  # fmt: skip
    """acc + (OFFSET + q) x and accx + sum x of one step."""
    xt = _b_operand(X, step, x_offs, x_mask, MP, B_LAYOUT)
    acc = mma_v2(_a_operand(words, R2, EXP, DTYPE, A_LAYOUT), xt, acc)
    accx = mma_v2(ones, xt, accx)
    return acc, accx


@gluon.jit
def _chunk_words(QW, step0, row_pair0, N_PAIRS: gl.constexpr, w_offs,
                 CHUNK_STEPS: gl.constexpr):  # fmt: skip
    """The words of a chunk of one or two 64-deep steps from step0 (both loads in flight
    together; one step: the second is the first again, unused)."""
    w0 = _step(QW, step0, row_pair0, N_PAIRS, w_offs)
    w1 = w0
    if CHUNK_STEPS == 2:
        w1 = _step(QW, step0 + 1, row_pair0, N_PAIRS, w_offs)
    return w0, w1


@gluon.jit
def _chunk(w0, w1, X, step0, x_offs, x_mask, ones, zero, CHUNK_STEPS: gl.constexpr,
           R2: gl.constexpr, MP: gl.constexpr, EXP: gl.constexpr, DTYPE: gl.constexpr,
           A_LAYOUT: gl.constexpr, B_LAYOUT: gl.constexpr):  # fmt: skip
    """acc (sum (OFFSET + q) x) and accx (sum x) of the chunk from step0 whose words are w0, w1
    (`_chunk_words`)."""
    acc, accx = _mma_step(w0, X, step0, x_offs, x_mask, ones, zero, zero, R2, MP, EXP, DTYPE,
                          A_LAYOUT, B_LAYOUT)  # fmt: skip
    if CHUNK_STEPS == 2:
        acc, accx = _mma_step(w1, X, step0 + 1, x_offs, x_mask, ones, acc, accx, R2, MP, EXP,
                              DTYPE, A_LAYOUT, B_LAYOUT)  # fmt: skip
    return acc, accx


@gluon.jit
def _scaled(out, acc, accx, S, Z, g, rows, OFFSET: gl.constexpr, N_ROWS: gl.constexpr,
            HAS_ZEROS: gl.constexpr):  # fmt: skip
    """out + s (acc - (OFFSET + z) accx) with the rows' scales and zeros of group g."""
    s = gl.load(S + g.to(gl.int64) * N_ROWS + rows).to(gl.float32)
    if HAS_ZEROS:
        z = gl.load(Z + g.to(gl.int64) * N_ROWS + rows).to(gl.float32)
    else:
        z = gl.full(s.shape, 8.0, gl.float32, layout=s.type.layout)
    return out + s[:, None] * (acc - (z + OFFSET)[:, None] * accx)


@gluon.jit
def _pdl_wait(PDL: gl.constexpr):
    """kernels/pdl.py's pdl_wait in Gluon: wait for the kernel before this one (its writes
    visible), then let the next one launch; every thread runs both, as tl's scalar ops do."""
    if PDL:
        one_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # WARPS
        t = gl.full([128], 0, gl.int32, layout=one_l)  # one a thread
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0 $1", "=r,r", [t], dtype=gl.int32,
                                  is_pure=False, pack=1)  # fmt: skip
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0 $1", "=r,r", [t],
                                  dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _swiglu_y(gate, up, DTYPE: gl.constexpr):
    """silu(gate) * up from fp32 sums, rounded as the unfused path rounds them (gate and up to
    the dtype, silu to the dtype, the product once), as kernels/gemv.py's _swiglu."""
    gate = gate.to(DTYPE).to(gl.float32)
    silu = (gate / (1.0 + gl.exp(-gate))).to(DTYPE)
    return silu.to(gl.float32) * up.to(DTYPE).to(gl.float32)


@gluon.jit
def _int4_gemv_mma_kernel(
    X,
    QW,
    S,
    Z,
    Y,
    WS,
    Counters,
    M,
    N: gl.constexpr,  # output rows (swiglu: of each half)
    K,
    chunks_per_split,
    stride_xm,
    stride_ym,
    GROUP: gl.constexpr,  # K rows a scale row covers (K itself: one group)
    CHUNK_STEPS: gl.constexpr,  # 64-deep steps a chunk (a chunk lies inside one group)
    MP: gl.constexpr,  # x's rows padded: the MMA's N (8 or 16)
    SPLIT_K: gl.constexpr,
    SWIGLU: gl.constexpr,
    HAS_ZEROS: gl.constexpr,
    EXP: gl.constexpr,
    OFFSET: gl.constexpr,
    PDL: gl.constexpr,
):
    """A program owns ROWS output rows (16 a warp; with swiglu the gate's and the up half's) and
    a K slice of whole chunks; the last slice to arrive writes y. With PDL it waits for the
    kernel before it (kernels/pdl.py's rule) before its first load."""
    ROWS_: gl.constexpr = 64  # 16 a warp, 4 warps
    R2: gl.constexpr = ROWS_ // 2
    N_ROWS: gl.constexpr = 2 * N if SWIGLU else N
    N_PAIRS: gl.constexpr = N_ROWS // 2
    DTYPE: gl.constexpr = X.dtype.element_ty
    # a thread's four words: its row pair (lanes // 4, warps), lane % 4, and the four k-blocks
    # in its registers (16 contiguous bytes)
    words_l: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[8, 0, 0], [16, 0, 0]],
        block_bases=[],
        shape=[R2, 4, 4],
    )
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8]
    )
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_l, k_width=2)

    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    r = gl.arange(0, R2, layout=gl.SliceLayout(1, gl.SliceLayout(2, words_l)))
    m = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, words_l)))
    b = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, words_l)))
    w_offs = r[:, None, None] * 16 + m[None, :, None] * 4 + b[None, None, :]
    # x's step as [MP, 4 (m), 16]: a thread's 16 contiguous values (registers), its m and row
    # (lanes); every warp the same
    if MP == 16:
        x_l: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [8, 0, 0]],
            lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[0, 0, 0], [0, 0, 0]],
            block_bases=[],
            shape=[MP, 4, 16],
        )
    else:
        x_l: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8]],
            lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[0, 0, 0], [0, 0, 0]],
            block_bases=[],
            shape=[MP, 4, 16],
        )
    tt = gl.arange(0, MP, layout=gl.SliceLayout(1, gl.SliceLayout(2, x_l)))
    mm = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, x_l)))
    jj = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, x_l)))
    x_offs = tt[:, None, None] * stride_xm + mm[None, :, None] * 16 + jj[None, None, :]
    x_mask = (tt < M)[:, None, None] & (mm >= 0)[None, :, None] & (jj >= 0)[None, None, :]
    ones = gl.full([ROWS_, 64], 1.0, DTYPE, layout=a_l)
    rows = pid_n * ROWS_ + gl.arange(0, ROWS_, layout=gl.SliceLayout(1, mma_l))
    cols = gl.arange(0, MP, layout=gl.SliceLayout(0, mma_l))
    zero = gl.zeros([ROWS_, MP], gl.float32, layout=mma_l)

    CHUNK: gl.constexpr = CHUNK_STEPS * 64
    first = pid_k * chunks_per_split
    last = gl.minimum(first + chunks_per_split, K // CHUNK)
    row_pair = pid_n * R2
    up_pair = N // 2 + pid_n * R2  # swiglu: the up half's rows
    out = zero
    out_up = zero
    _pdl_wait(PDL)
    for c in range(first, last):
        w0, w1 = _chunk_words(QW, c * CHUNK_STEPS, row_pair, N_PAIRS, w_offs, CHUNK_STEPS)
        acc, accx = _chunk(w0, w1, X, c * CHUNK_STEPS, x_offs, x_mask, ones, zero,
                           CHUNK_STEPS, R2, MP, EXP, DTYPE, a_l, b_l)  # fmt: skip
        g = (c * CHUNK) // GROUP
        out = _scaled(out, acc, accx, S, Z, g, rows, OFFSET, N_ROWS, HAS_ZEROS)
        if SWIGLU:
            w0, w1 = _chunk_words(QW, c * CHUNK_STEPS, up_pair, N_PAIRS, w_offs,
                                  CHUNK_STEPS)  # fmt: skip
            acc, accx = _chunk(w0, w1, X, c * CHUNK_STEPS, x_offs, x_mask, ones, zero,
                               CHUNK_STEPS, R2, MP, EXP, DTYPE, a_l, b_l)  # fmt: skip
            out_up = _scaled(out_up, acc, accx, S, Z, g, rows + N, OFFSET, N_ROWS,
                             HAS_ZEROS)  # fmt: skip

    mask = (cols < M)[None, :] & (rows < N)[:, None]
    y_offs = cols[None, :] * stride_ym + rows[:, None]
    if SPLIT_K > 1:
        ws_n: gl.constexpr = N_ROWS
        plane = M * ws_n
        ws_offs = cols[None, :] * ws_n + rows[:, None]
        gl.store(WS + pid_k * plane + ws_offs, out, mask=mask)
        if SWIGLU:
            gl.store(WS + pid_k * plane + ws_offs + N, out_up, mask=mask)
        # NOTE: every thread's stores before the one release (as kernels/gemv.py): bar.sync,
        # then a gpu-scope acq_rel atomic; the last slice's acquire sees every plane
        _cta_barrier()
        arrived = gl.atomic_add(Counters + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            out = zero
            out_up = zero
            for s in gl.static_range(SPLIT_K):
                out += gl.load(WS + s * plane + ws_offs, mask=mask, other=0.0, cache_modifier=".cg")
                if SWIGLU:
                    out_up += gl.load(WS + s * plane + ws_offs + N, mask=mask, other=0.0,
                                      cache_modifier=".cg")  # fmt: skip
            if SWIGLU:
                gl.store(Y + y_offs, _swiglu_y(out, out_up, DTYPE).to(DTYPE), mask=mask)
            else:
                gl.store(Y + y_offs, out.to(DTYPE), mask=mask)
            gl.atomic_xchg(Counters + pid_n, 0, sem="relaxed", scope="gpu")  # the next call's
    else:
        if SWIGLU:
            gl.store(Y + y_offs, _swiglu_y(out, out_up, DTYPE).to(DTYPE), mask=mask)
        else:
            gl.store(Y + y_offs, out.to(DTYPE), mask=mask)


def takes(w: Int4MmaPacked, m: int, swiglu: bool = False) -> bool:
    """Whether int4_gemv_mma runs x [m, K] @ W^T: m <= MAX_M, whole programs of rows (of each
    half with swiglu)."""
    n = w.out_features // 2 if swiglu else w.out_features
    return m <= MAX_M and n % ROWS == 0


def pick_split(n: int, k: int, chunk: int) -> int:
    """K slices by SPLIT (each at least two chunks)."""
    return split_k_for(n // ROWS, k, chunk, SPLIT)


def int4_gemv_mma(
    x: torch.Tensor,  # [M, K], M <= 16, unit stride along K; bf16 or fp16
    w: Int4MmaPacked,
    swiglu: bool = False,
    split_k: int | None = None,
    pdl: bool = False,  # launched with programmatic dependent launch (kernels/pdl.py)
) -> torch.Tensor:
    """x @ W^T: [M, N] in x's dtype; with swiglu, silu(x @ W_gate^T) * (x @ W_up^T): [M, N / 2]."""
    m, k = x.shape
    assert k == w.in_features and x.stride(1) == 1, (x.shape, x.stride(), w.in_features)
    assert x.dtype in EXP_BITS, x.dtype
    assert takes(w, m, swiglu), (m, w.out_features, swiglu)
    n_rows = w.out_features
    n = n_rows // 2 if swiglu else n_rows
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    group = min(w.group_size, k)
    chunk_steps = 2 if group % (2 * MMA_K) == 0 and k % (2 * MMA_K) == 0 else 1
    chunk = chunk_steps * MMA_K
    split = split_k or pick_split(n, k, chunk)
    chunks = k // chunk
    per_split = triton.cdiv(chunks, split)
    split = triton.cdiv(chunks, per_split)
    if n // ROWS > NUM_COUNTERS:
        split, per_split = 1, chunks
    counters = split_counters(x.device) if split > 1 else y
    ws = y
    if split > 1:
        ws = torch.empty(split * m * n_rows, dtype=torch.float32, device=x.device)
    exp_bits, offset = EXP_BITS[x.dtype]
    _int4_gemv_mma_kernel[(n // ROWS, split)](
        x, w.qweight, w.scales, y if w.zeros is None else w.zeros, y, ws, counters,
        m, n, k, per_split, x.stride(0), y.stride(0),
        GROUP=group, CHUNK_STEPS=chunk_steps, MP=8 if m <= 8 else 16, SPLIT_K=split,
        SWIGLU=swiglu, HAS_ZEROS=w.zeros is not None, EXP=exp_bits, OFFSET=offset,
        num_warps=WARPS, **pdl_launch_kwargs(pdl, x),
    )  # fmt: skip
    return y
