"""W8A16 decode matmul on the tensor cores without a shared-memory round trip: y[M, N] =
x[M, K] @ (sw * W)^T for M <= 16, the weight float8_e4m3fn in its checkpoint's row-major order
(one float32 scale a row, or one a 128 x 128 block), x in bf16 / fp16 and not quantized. Written
in Gluon (Triton's explicit-layout dialect), as kernels/int4_gemv_mma.py, whose x operand and
K permutation it shares: KernelConfig.fp8_decode "w8a16"'s decode matmuls.

The weight is the A operand of mma.m16n8k16 (16 output rows a warp), x the B operand (its M rows
padded to 8 or 16 columns). Inside each 64-deep K step, the MMA's column 16 b + 8 b_8 + 2 m + b_1
is K row 16 m + 4 b + 2 b_8 + b_1 of the step (int4_gemv_mma's order): a thread (lane % 4 = m)
then holds, for each of its two rows, the 16 contiguous bytes 16 m .. 16 m + 15 of the step, one
16-byte load a row, and its x fragments are 16 contiguous values of x. The weight needs no
repacking, so the checkpoint's tensor serves prefill (torch._scaled_mm) and decode alike. Each
e4m3 value becomes the dtype's value exactly (e4m3 values are bf16 and fp16 values), in
registers; `gl.convert_layout(..., assert_trivial=True)` proves at compile time that the
converted bytes are the operand's registers (no shared memory). Products are exact and summed in
fp32; the row scales apply once after the sums, a block's scale once a 128-deep chunk.

kernels/fp8_gemv.py's Triton mode (`weight_only=True`) computes the same product through the
compiler's shared-memory pipeline: a 2-byte shared load and two conversions a weight value
(Triton 3.6, sm_90: a 128-deep tile is 304 instructions a thread).

`fp8_gemv_mma_residual` adds the residual in the epilogue and, for one row, normalizes the sum
in the program that finishes last, as kernels/gemv.py's gemv_residual (decode_norms "all" /
"post" on an FP8 model decoding W8A16).

Split-K reduces in the kernel, deterministically, as kernels/gemv.py's: each K slice stores its
fp32 sums to its plane of a [SPLIT_K, M, N] workspace ([SPLIT_K, M, 2N] with swiglu), the slice
that arrives last sums the planes in slice order and writes y.

Gluon has no CPU interpreter: this kernel is checked by compiling it here
(scripts/check_kernels_compile.py) and by tests/gpu/test_fp8_gemv_gpu.py.

    y = fp8_gemv_mma(x, w, w_scale)                       # w_scale float32 [N]
    y = fp8_gemv_mma(x, w, w_scale, blocks=True)          # w_scale [N / 128, K / 128]
    a = fp8_gemv_mma(x, w_gate_up, w_scale, swiglu=True)  # silu(gate) * up, [M, N / 2]
    h, normed = fp8_gemv_mma_residual(x, w, w_scale, residual, norm=(g, eps))
"""

from __future__ import annotations

import torch
import triton
from batchrun.kernels.gemv import NUM_COUNTERS, ResidualStream, check_residual, split_counters
from batchrun.kernels.int4_gemv_mma import (
    _b_operand,
    _finish,
    _pdl_wait,
    _x_offsets,
    pick_split,
)
from batchrun.kernels.pdl import pdl_launch_kwargs
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

MAX_M = 16
WARPS = 4
ROWS = 16 * WARPS  # output rows a program: 16 a warp
STEP = 64  # K rows a step: one 16-byte load a thread and row
BLOCK = 128  # block FP8's weight blocks: a chunk of two steps


@gluon.jit
def _w_step(W, step, w_offs, DTYPE: gl.constexpr, A_LAYOUT: gl.constexpr):
    """A 64-deep step of the weight as the A operand [64, 64] in DTYPE: each thread's 16 bytes
    of each of its two rows (w_offs [R2, 2 (b_r8), 4 (m), 16 (j)]), converted, then reshaped and
    permuted into the operand's rows 16 (r' // 8) + 8 b_r8 + r' % 8 and columns
    16 b + 8 b_8 + 2 m + b_1 (j = 4 b + 2 b_8 + b_1)."""
    w = gl.load(W + step * 64 + w_offs).to(DTYPE)
    R2: gl.constexpr = w.shape[0]
    w = gl.reshape(w, [R2 // 8, 8, 2, 4, 4, 2, 2])  # [w4, r8, b_r8, m, b, b_8, b_1]
    w = gl.permute(w, (0, 2, 1, 4, 5, 3, 6))  # [w4, b_r8, r8, b, b_8, m, b_1]
    return gl.convert_layout(gl.reshape(w, [2 * R2, 64]), A_LAYOUT, assert_trivial=True)


@gluon.jit
def _chunk(acc, W, X, step0, w_offs, x_offs, x_mask, CHUNK_STEPS: gl.constexpr,
           MP: gl.constexpr, DTYPE: gl.constexpr, A_LAYOUT: gl.constexpr,
           B_LAYOUT: gl.constexpr):  # fmt: skip
    """acc [64, MP] plus the sums of CHUNK_STEPS steps from step0 (both steps' weight loads
    issued before the first MMA)."""
    a0 = _w_step(W, step0, w_offs, DTYPE, A_LAYOUT)
    a1 = a0
    if CHUNK_STEPS == 2:
        a1 = _w_step(W, step0 + 1, w_offs, DTYPE, A_LAYOUT)
    acc = mma_v2(a0, _b_operand(X, step0, x_offs, x_mask, MP, B_LAYOUT), acc)
    if CHUNK_STEPS == 2:
        acc = mma_v2(a1, _b_operand(X, step0 + 1, x_offs, x_mask, MP, B_LAYOUT), acc)
    return acc


@gluon.jit
def _fp8_gemv_mma_kernel(
    X,
    W,
    SW,
    Y,
    WS,
    Counters,
    R,  # ADD_RES: the residual [M, N]
    G,  # NORM_OUT: the norm's weight [N]
    NormOut,  # NORM_OUT: rmsnorm(y) * G, [1, N]
    M,
    N: gl.constexpr,  # output rows (swiglu: of each half)
    K,
    chunks_per_split,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_rm,
    stride_swn,  # BLOCKS: SW [N_ROWS / 128, K / 128], a block row's
    eps,
    CHUNK_STEPS: gl.constexpr,  # 64-deep steps a chunk (BLOCKS: two, one 128-column group)
    MP: gl.constexpr,  # x's rows padded: the MMA's N (8 or 16)
    SPLIT_K: gl.constexpr,
    SWIGLU: gl.constexpr,
    BLOCKS: gl.constexpr,
    ADD_RES: gl.constexpr,  # y = the product + R
    NORM_OUT: gl.constexpr,  # and, for one row, rmsnorm(y) * G by the program finishing last
    BLOCK_ROW: gl.constexpr,  # NORM_OUT: the row's width, a power of two
    PDL: gl.constexpr,
):
    """A program owns ROWS output rows (16 a warp; with swiglu the gate's and the up half's) and
    a K slice of whole chunks; the last slice to arrive writes y. With PDL it waits for the
    kernel before it (kernels/pdl.py's rule) before its first load."""
    ROWS_: gl.constexpr = 64  # 16 a warp, 4 warps
    R2: gl.constexpr = ROWS_ // 2
    DTYPE: gl.constexpr = X.dtype.element_ty
    # a thread's bytes: its row pair r' (lanes // 4, warps), both rows of the pair (b_r8), its
    # lane % 4 (m) and the 16 contiguous bytes j of the step (registers)
    w_l: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 0, 8], [0, 1, 0, 0]],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[8, 0, 0, 0], [16, 0, 0, 0]],
        block_bases=[],
        shape=[R2, 2, 4, 16],
    )
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8]
    )
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_l, k_width=2)

    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    rp = gl.arange(0, R2, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, w_l))))
    r8 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, w_l))))
    m = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, w_l))))
    j = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, w_l))))
    w_row = pid_n * ROWS_ + 16 * (rp // 8)[:, None] + 8 * r8[None, :] + (rp % 8)[:, None]
    w_offs = (w_row.to(gl.int64) * stride_wn)[:, :, None, None] + (16 * m)[None, None, :, None]
    w_offs = w_offs + j[None, None, None, :]
    up_offs = w_offs + N * stride_wn  # swiglu: the up half's rows
    x_offs, x_mask = _x_offsets(M, stride_xm, MP)
    rows = pid_n * ROWS_ + gl.arange(0, ROWS_, layout=gl.SliceLayout(1, mma_l))
    cols = gl.arange(0, MP, layout=gl.SliceLayout(0, mma_l))
    zero = gl.zeros([ROWS_, MP], gl.float32, layout=mma_l)

    CHUNK: gl.constexpr = CHUNK_STEPS * 64
    first = pid_k * chunks_per_split
    last = gl.minimum(first + chunks_per_split, K // CHUNK)
    out = zero
    out_up = zero
    _pdl_wait(PDL)
    for c in range(first, last):
        step0 = c * CHUNK_STEPS
        if BLOCKS:  # each 128-column group's sums times its block's scale
            acc = _chunk(zero, W, X, step0, w_offs, x_offs, x_mask, CHUNK_STEPS, MP, DTYPE,
                         a_l, b_l)  # fmt: skip
            s = gl.load(SW + (rows // 128) * stride_swn + c)
            out += acc * s[:, None]
            if SWIGLU:
                acc = _chunk(zero, W, X, step0, up_offs, x_offs, x_mask, CHUNK_STEPS, MP, DTYPE,
                             a_l, b_l)  # fmt: skip
                s = gl.load(SW + ((rows + N) // 128) * stride_swn + c)
                out_up += acc * s[:, None]
        else:
            out = _chunk(out, W, X, step0, w_offs, x_offs, x_mask, CHUNK_STEPS, MP, DTYPE, a_l,
                         b_l)  # fmt: skip
            if SWIGLU:
                out_up = _chunk(out_up, W, X, step0, up_offs, x_offs, x_mask, CHUNK_STEPS, MP,
                                DTYPE, a_l, b_l)  # fmt: skip
    if not BLOCKS:  # the rows' scales, once after the sums
        out = out * gl.load(SW + rows)[:, None]
        if SWIGLU:
            out_up = out_up * gl.load(SW + N + rows)[:, None]

    res = zero
    if ADD_RES:  # [64, MP] of R [M, N]
        mask = (cols < M)[None, :] & (rows < N)[:, None]
        res = gl.load(R + cols[None, :] * stride_rm + rows[:, None], mask=mask, other=0.0)
    _finish(out, out_up, res, Y, WS, Counters, G, NormOut, rows, cols, M, N, stride_ym, eps,
            pid_n, pid_k, DTYPE, SPLIT_K, SWIGLU, ADD_RES, NORM_OUT, BLOCK_ROW)  # fmt: skip


def takes(n_rows: int, k: int, m: int, blocks: bool = False, swiglu: bool = False) -> bool:
    """Whether fp8_gemv_mma runs x [m, k] against a weight [n_rows, k]: m <= MAX_M, whole
    programs of rows (of each half with swiglu), whole 64-deep steps (block FP8: whole
    128-column groups and blocks)."""
    n = n_rows // 2 if swiglu else n_rows
    whole = n % ROWS == 0 and k % (BLOCK if blocks else STEP) == 0
    return 0 < m <= MAX_M and whole and (not blocks or not swiglu or n % BLOCK == 0)


def fp8_gemv_mma(
    x: torch.Tensor,  # [M, K], M <= 16, unit stride along K; bf16 or fp16
    w: torch.Tensor,  # [N, K] float8_e4m3fn, unit stride along K; swiglu: [2I, K]
    w_scale: torch.Tensor,  # float32 [N] (contiguous); blocks: [N / 128, K / 128]
    *,
    blocks: bool = False,
    swiglu: bool = False,
    split_k: int | None = None,
    pdl: bool = False,  # launched with programmatic dependent launch (kernels/pdl.py)
) -> torch.Tensor:
    """x @ (sw * w)^T: [M, N] in x's dtype; with swiglu, silu(gate) * up: [M, N / 2]."""
    return _launch(x, w, w_scale, blocks, swiglu, split_k, pdl, None, None)[0]


def fp8_gemv_mma_residual(
    x: torch.Tensor,  # [M, K], as fp8_gemv_mma's
    w: torch.Tensor,  # [N, K] float8_e4m3fn
    w_scale: torch.Tensor,
    residual: torch.Tensor,  # [M, N], x's dtype, unit stride along N; not written
    norm: tuple[torch.Tensor, float] | None = None,  # (weight [N], eps); only for M = 1
    *,
    blocks: bool = False,
    split_k: int | None = None,
    pdl: bool = False,
) -> ResidualStream:
    """h = x @ (sw * w)^T + residual, rounded as the unfused `linear + residual`; with norm,
    also rmsnorm(h) * weight for one row, computed by the program of rows that finishes last
    (kernels/gemv.py's gemv_residual, on FP8 weights)."""
    check_residual(x, w.shape[0], residual, norm)
    return ResidualStream(*_launch(x, w, w_scale, blocks, False, split_k, pdl, residual, norm))


def _launch(x, w, w_scale, blocks, swiglu, split_k, pdl, residual,
            norm) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """(y, normed): normed when norm is given, else None."""
    m, k = x.shape
    n_rows = w.shape[0]
    assert w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1, (x.shape, w.shape)
    assert w.dtype == torch.float8_e4m3fn and x.dtype in (torch.bfloat16, torch.float16)
    assert takes(n_rows, k, m, blocks, swiglu), (m, w.shape, blocks, swiglu)
    assert w_scale.dtype == torch.float32
    if blocks:
        assert w_scale.shape == (triton.cdiv(n_rows, BLOCK), k // BLOCK) and w_scale.stride(1) == 1
    else:
        assert w_scale.shape == (n_rows,) and w_scale.is_contiguous()
    n = n_rows // 2 if swiglu else n_rows
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    normed = None if norm is None else torch.empty_like(y)
    chunk_steps = 2 if k % (2 * STEP) == 0 else 1
    chunks = k // (chunk_steps * STEP)
    # int4_gemv_mma's rule (64-row programs, as here): about 1,536 programs
    split = split_k or pick_split(n, k, chunk_steps * STEP)
    per_split = triton.cdiv(chunks, split)
    split = triton.cdiv(chunks, per_split)
    if n // ROWS > NUM_COUNTERS:
        split, per_split = 1, chunks
    # the split counters and, past them, the norm's row counter
    counters = split_counters(x.device) if split > 1 or norm is not None else y
    ws = y
    if split > 1:
        ws = torch.empty(split * m * n_rows, dtype=torch.float32, device=x.device)
    # NOTE: absent operands get y as a stand-in pointer: their constexpr flag prunes every access
    r = y if residual is None else residual
    norm_w, eps = (y, 0.0) if norm is None else norm
    _fp8_gemv_mma_kernel[(n // ROWS, split)](
        x, w, w_scale, y, ws, counters, r, norm_w, y if normed is None else normed, m, n, k,
        per_split, x.stride(0), w.stride(0), y.stride(0), r.stride(0),
        w_scale.stride(0) if blocks else 0, eps,
        CHUNK_STEPS=chunk_steps, MP=8 if m <= 8 else 16, SPLIT_K=split, SWIGLU=swiglu,
        BLOCKS=blocks, ADD_RES=residual is not None, NORM_OUT=norm is not None,
        BLOCK_ROW=max(triton.next_power_of_2(n if norm is not None else 1), 128),
        num_warps=WARPS, **pdl_launch_kwargs(pdl, x),
    )  # fmt: skip
    return y, normed
