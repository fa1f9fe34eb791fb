"""Skinny FP8 matmul for decode: y[M, N] = sx[m] * sw[n] * (q(x)[M, K] @ w[N, K]^T) for M <= 16,
the weight float8_e4m3fn with one float32 scale per output row (a per-tensor scale broadcast),
the activations quantized per token inside the kernel, as their tiles are loaded:

    q(x) = x / sx[m] clamped to +-448, rounded to e4m3 (to nearest even), in registers
    sx[m] = max(max |x[m, :]| * fp32(1 / 448), 1e-12)   dynamic (act_quant.py's torch ops)
    sx[m] = the checkpoint's input_scale           static

No quantized copy of x is written: the matmul that torch._scaled_mm runs after a chain of torch
ops (abs, amax, divide, clamp, cast) is one kernel here. The dynamic scale needs the whole row
before the first tile is quantized: each program reduces its rows' |max| itself (`amax_in_kernel`:
a few KB from L2, no kernel of its own; a row-parallel layer's maximum over the tensor-parallel
ranks and large M use `row_amax` before the kernel instead, one reduction, then the kernel takes
the maxima). The scale and the division are those of quant_per_token's torch ops on CUDA (a
Python scalar divides as a multiplication by its reciprocal; tensors divide exactly), so q(x) has
their bytes: bf16 activations over a scale of amax / 448 land on e4m3 midpoints often, and an ulp
of difference there moves the rounding.

Products of e4m3 values are exact in fp32, so the dot is exact whichever operands it takes:
`fp8_dot` multiplies the e4m3 operands on the tensor cores, each K tile's dot into fresh zeros
added in fp32 (full-precision accumulation whatever MMA Triton picks); without it both operands
are widened to fp16 (exact for e4m3) first. The result equals quant_per_token + torch._scaled_mm
up to the order of accumulation; the scales apply after the sum, as ((acc * sw) * sx), the order
of torch's row-wise scaled matmul epilogue, and y is rounded once to x's dtype.

Everything else is kernels/gemv.py's, whose helpers this reuses: a program owns BLOCK_N output
rows of w and, with SPLIT_K > 1, one K slice of them; split-K reduces in the kernel (fp32 planes
summed in slice order by the last slice, the shared per-device counters); the first two weight
tiles (and the weight scales) load before the PDL wait; with swiglu, w is the fused [2I, K]
gate_up weight (scales [2I]) and y = silu(gate) * up, [M, I], gate and up each rounded to the
dtype first as the unfused path rounds them.

On CPU tensors (Triton's interpreter, whose float-to-e4m3 cast truncates where it should carry)
the rounding to e4m3 is done in fp32 arithmetic (`_round_e4m3`), then cast (exact); on the GPU it
is the hardware's cast (cvt.rn.satfinite).

    y = fp8_gemv(x, w, w_scale)                        # dynamic per-token activations
    y = fp8_gemv(x, w, w_scale, input_scale=s)         # static, s float32 scalar
    a = fp8_gemv(x, w_gate_up, scale_gate_up, swiglu=True)
    y = fp8_gemv(x, w, w_scale, amax=reduce_max(row_amax(x)))  # TP: the maxima of all ranks
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from batchrun.kernels.fp8_quant import quant_per_token, quant_static
from batchrun.kernels.gemv import (
    MAX_M,
    NUM_COUNTERS,
    SMEM_FOR_W,
    _sum_planes,
    _swiglu,
    _w_tile,
    _x_tile,
    split_counters,
)
from batchrun.kernels.pdl import pdl_launch_kwargs, pdl_wait

FP8_MAX = tl.constexpr(448.0)
INV_FP8_MAX = tl.constexpr(1.0 / 448.0)
MIN_SCALE = tl.constexpr(1e-12)  # batchrun/quant/act_quant.py's: an all-zero row gives zeros
# elements of x a program loads at once to reduce its rows' |max| (16 KB of bf16)
AMAX_TILE = 8192
# SCALE modes: where sx comes from
SCALE_AMAX_IN_KERNEL, SCALE_FROM_AMAX, SCALE_GIVEN = 0, 1, 2


class Fp8GemvConfig(NamedTuple):
    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    fp8_dot: bool = True  # the dot on e4m3 operands; else both widened to fp16
    fma: bool = False  # M = 1 only: the dot as fp32 multiply-adds (no tensor cores)
    amax_in_kernel: bool = True  # dynamic: each program reduces its rows' |max| (else row_amax)
    swap_ab: bool = False  # x quantized first (fp8_quant), w @ q(x)^T on wgmma (_fp8_swap_kernel)
    promote: bool = True  # swap_ab: each K tile's dot added in fp32 (else one running accumulator)


@triton.jit
def _round_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3fn value, ties to even, as fp32: the
    normal range keeps 3 mantissa bits; below 2^-6 the subnormal step is 2^-9."""
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    lsb = (mag >> 20) & 1
    normal = ((mag + 0x7FFFF + lsb) & -0x100000).to(tl.float32, bitcast=True)
    a = tl.abs(v) * 512.0  # subnormal: multiples of 2^-9, rounded to even by the fp32 add
    sub = ((a + 8388608.0) - 8388608.0) * (1.0 / 512.0)
    r = tl.where(mag < (121 << 23), sub, normal)  # 121 << 23: the bits of 2^-6
    return tl.where(v < 0, -r, r)


@triton.jit
def _quantize(x, sx, HW_CAST: tl.constexpr, FP8_DOT: tl.constexpr):
    """x [16, BLOCK_K] divided by its rows' sx (IEEE, as quant_per_token's torch ops divide),
    clamped and rounded to e4m3: the dot's operand (float8, or fp16 holding the same values)."""
    v = tl.clamp(tl.math.div_rn(x.to(tl.float32), sx[:, None]), -FP8_MAX, FP8_MAX)
    if not HW_CAST:
        v = _round_e4m3(v)
    q = v.to(tl.float8e4nv)
    if not FP8_DOT:  # NOTE: one return statement (Triton 3.6 rejects returns of two types)
        q = q.to(tl.float16)
    return q


@triton.jit
def _mma8(acc, q, w, FP8_DOT: tl.constexpr, FMA: tl.constexpr):
    if FMA:  # one row: [1, BLOCK_K] times [BLOCK_N, BLOCK_K], summed along K in fp32
        acc = acc + tl.sum(q.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    elif FP8_DOT:  # each tile's dot from zeros, summed in fp32 (no reduced-precision accumulator)
        acc = acc + tl.dot(q, tl.trans(w))
    else:  # NOTE: one return statement (Triton 3.6 rejects returns of two types)
        acc = tl.dot(q, tl.trans(w.to(tl.float16)), acc)
    return acc


@triton.jit
def _rows_amax(X, M, K, stride_xm, AMAX_M: tl.constexpr, AMAX_K: tl.constexpr,
               ROWS: tl.constexpr):  # fmt: skip
    """max |x[m, :]| for the rows m < M, as a [ROWS] vector (zeros past M): [AMAX_M, AMAX_K]
    tiles (AMAX_M the next power of two of M), so one row is read in few loads."""
    offs_r = tl.arange(0, AMAX_M)
    amax = tl.zeros([AMAX_M], dtype=tl.float32)
    for k0 in range(0, K, AMAX_K):
        offs_k = k0 + tl.arange(0, AMAX_K)
        mask = (offs_r[:, None] < M) & (offs_k < K)[None, :]
        x = tl.load(X + offs_r[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    # the [AMAX_M] maxima as the [ROWS] rows of the dot's tiles
    offs_m = tl.arange(0, ROWS)
    pick = offs_m[:, None] == offs_r[None, :]
    return tl.max(tl.where(pick, amax[None, :], 0.0), axis=1)


@triton.jit
def _fp8_gemv_kernel(
    X,
    W,
    SW,
    XS,
    Y,
    WS,
    Counters,
    M,
    N,
    K,
    k_per_split,
    up_offset,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_xs,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SWIGLU: tl.constexpr,
    SCALE: tl.constexpr,
    AMAX_M: tl.constexpr,
    AMAX_K: tl.constexpr,
    FP8_DOT: tl.constexpr,
    FMA: tl.constexpr,  # one row (ROWS 1), multiply-adds
    ROWS: tl.constexpr,  # x's rows a tile holds: 16 (the tensor cores' padding), 1 with FMA
    HW_CAST: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, ROWS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    up_rows = w_rows + up_offset  # SWIGLU: the up half's rows, N below
    in_n = offs_n[:, None] < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # weights and their scales are no earlier kernel's output: loaded before the PDL wait
    w = _w_tile(w_rows, in_n, k_start, k_end, BLOCK_K)
    w2 = _w_tile(w_rows, in_n, k_start + BLOCK_K, k_end, BLOCK_K)  # zeros past k_end
    sw = tl.load(SW + offs_n, mask=offs_n < N, other=0.0)
    w_up = w
    w2_up = w2
    sw_up = sw
    if SWIGLU:
        w_up = _w_tile(up_rows, in_n, k_start, k_end, BLOCK_K)
        w2_up = _w_tile(up_rows, in_n, k_start + BLOCK_K, k_end, BLOCK_K)
        sw_up = tl.load(SW + N + offs_n, mask=offs_n < N, other=0.0)
    pdl_wait(PDL)
    in_m = offs_m < M
    if SCALE == 2:  # SCALE_GIVEN (static: one value, stride 0)
        sx = tl.load(XS + offs_m * stride_xs, mask=in_m, other=1.0)
    else:
        if SCALE == 0:  # SCALE_AMAX_IN_KERNEL
            amax = _rows_amax(X, M, K, stride_xm, AMAX_M, AMAX_K, ROWS)
        else:  # SCALE_FROM_AMAX
            amax = tl.load(XS + offs_m * stride_xs, mask=in_m, other=0.0)
        # amax times fp32(1 / 448): how torch's CUDA division by a Python scalar computes it
        sx = tl.maximum(amax * INV_FP8_MAX, MIN_SCALE)

    x = _quantize(_x_tile(X, offs_m, M, stride_xm, k_start, k_end, BLOCK_K), sx, HW_CAST, FP8_DOT)
    acc = _mma8(tl.zeros([ROWS, BLOCK_N], dtype=tl.float32), x, w, FP8_DOT, FMA)
    acc_up = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    if SWIGLU:
        acc_up = _mma8(acc_up, x, w_up, FP8_DOT, FMA)
    x = _x_tile(X, offs_m, M, stride_xm, k_start + BLOCK_K, k_end, BLOCK_K)
    x = _quantize(x, sx, HW_CAST, FP8_DOT)
    acc = _mma8(acc, x, w2, FP8_DOT, FMA)
    if SWIGLU:
        acc_up = _mma8(acc_up, x, w2_up, FP8_DOT, FMA)
    for k0 in range(k_start + 2 * BLOCK_K, k_end, BLOCK_K):
        x = _quantize(_x_tile(X, offs_m, M, stride_xm, k0, k_end, BLOCK_K), sx, HW_CAST, FP8_DOT)
        acc = _mma8(acc, x, _w_tile(w_rows, in_n, k0, k_end, BLOCK_K), FP8_DOT, FMA)
        if SWIGLU:
            acc_up = _mma8(acc_up, x, _w_tile(up_rows, in_n, k0, k_end, BLOCK_K), FP8_DOT, FMA)

    _finish(acc, acc_up, sx, sw, sw_up, Y, WS, Counters, offs_m, offs_n, M, N, stride_ym, pid_n,
            pid_k, SPLIT_K, SWIGLU)  # fmt: skip


@triton.jit
def _finish(acc, acc_up, sx, sw, sw_up, Y, WS, Counters, offs_m, offs_n, M, N, stride_ym, pid_n,
            pid_k, SPLIT_K: tl.constexpr, SWIGLU: tl.constexpr):  # fmt: skip
    """y from a program's fp32 sums acc [ROWS, BLOCK_N] (and acc_up): written scaled, or with
    SPLIT_K > 1 stored to this slice's plane, the last slice summing the planes into y."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    dtype = Y.dtype.element_ty
    if SPLIT_K == 1:
        _write_scaled(acc, acc_up, sx, sw, sw_up, out, mask, dtype, SWIGLU)
    else:
        # planes [SPLIT_K, M, WS_N]: WS_N = N, or 2N with the up sums in the second half
        ws_n = 2 * N if SWIGLU else N
        plane_stride = M * ws_n
        plane_offs = offs_m[:, None] * ws_n + offs_n[None, :]
        tl.store(WS + pid_k * plane_stride + plane_offs, acc, mask=mask)
        if SWIGLU:
            tl.store(WS + pid_k * plane_stride + plane_offs + N, acc_up, mask=mask)
        # NOTE: the release / acquire of kernels/gemv.py: every thread's stores, a CTA barrier,
        # one gpu-scope acq_rel atomic; the last slice reads the others' planes from L2
        tl.debug_barrier()
        counter = Counters + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = _sum_planes(WS, plane_offs, mask, plane_stride, SPLIT_K)
            total_up = total
            if SWIGLU:
                total_up = _sum_planes(WS, plane_offs + N, mask, plane_stride, SPLIT_K)
            _write_scaled(total, total_up, sx, sw, sw_up, out, mask, dtype, SWIGLU)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next call


@triton.jit
def _write_scaled(acc, acc_up, sx, sw, sw_up, out, mask, dtype: tl.constexpr,
                  SWIGLU: tl.constexpr):  # fmt: skip
    """y from the fp32 sums: (acc * sw) * sx rounded to the dtype, or the SwiGLU gate of the
    gate and up sums so scaled."""
    y = (acc * sw[None, :]) * sx[:, None]
    if SWIGLU:
        up = (acc_up * sw_up[None, :]) * sx[:, None]
        y = _swiglu(y, up, dtype)
    tl.store(out, y.to(dtype), mask=mask)


@triton.jit
def _swap_dot(acc, w, xq, PROMOTE: tl.constexpr):
    """acc [BLOCK_N, 16] + w [BLOCK_N, BLOCK_K] @ xq^T on e4m3 operands: the weight tile is the
    MMA's M side (wgmma), x's 16 padded rows its N side. PROMOTE: the tile's dot from zeros,
    added in fp32 (the tensor cores' reduced-precision accumulator spans one K tile)."""
    if PROMOTE:
        acc = acc + tl.dot(w, tl.trans(xq))
    else:
        acc = tl.dot(w, tl.trans(xq), acc)
    return acc


@triton.jit
def _fp8_swap_kernel(
    XQ,
    W,
    SW,
    XS,
    Y,
    WS,
    Counters,
    M,
    N,
    K,
    k_per_split,
    up_offset,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_xs,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SWIGLU: tl.constexpr,
    PROMOTE: tl.constexpr,
    PDL: tl.constexpr,
):
    """y from q(x) (e4m3 [M, K], rows' scales XS) and w: BLOCK_N rows of w a program, streamed
    in [BLOCK_N, BLOCK_K] tiles through the compiler's pipelined shared-memory stages."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    up_rows = w_rows + up_offset  # SWIGLU: the up half's rows, N below
    in_n = offs_n[:, None] < N
    in_m = offs_m < M
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    sw = tl.load(SW + offs_n, mask=offs_n < N, other=0.0)
    sw_up = sw
    if SWIGLU:
        sw_up = tl.load(SW + N + offs_n, mask=offs_n < N, other=0.0)
    pdl_wait(PDL)
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < k_end
        xq = tl.load(XQ + offs_m[:, None] * stride_xm + offs_k[None, :],
                     mask=in_m[:, None] & in_k[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_rows + offs_k[None, :], mask=in_n & in_k[None, :], other=0.0)
        acc = _swap_dot(acc, w, xq, PROMOTE)
        if SWIGLU:
            w_up = tl.load(up_rows + offs_k[None, :], mask=in_n & in_k[None, :], other=0.0)
            acc_up = _swap_dot(acc_up, w_up, xq, PROMOTE)
    sx = tl.load(XS + offs_m * stride_xs, mask=in_m, other=1.0)
    _finish(tl.trans(acc), tl.trans(acc_up), sx, sw, sw_up, Y, WS, Counters, offs_m, offs_n, M,
            N, stride_ym, pid_n, pid_k, SPLIT_K, SWIGLU)  # fmt: skip


# NOTE: the dynamic scale inside the kernel while the rows take at most this many elements of
# [AMAX_M, K] tiles (two loads of AMAX_TILE): llama-8b's K = 4096 up to M = 4, K = 14336 at M = 1;
# beyond, a program would read its rows in more round trips than one reduction kernel costs
AMAX_IN_KERNEL_MAX = 2 * AMAX_TILE


# the swapped kernel's programs: splits along K up to this many programs (at most 8 slices of at
# least two K tiles)
SWAP_TARGET_PROGRAMS = 512


def pick_config(m: int, n: int, k: int) -> Fp8GemvConfig:
    """x quantized first, then the swapped dot (_fp8_swap_kernel) on 64-row x 128-wide tiles,
    split along K up to SWAP_TARGET_PROGRAMS programs: w streams at 2.3-3.8 TB/s on llama-8b's
    matrices at M = 1 and 16 on the H200 where the in-kernel quantization's multiply-adds read
    1.2-1.3 TB/s and torch._scaled_mm 0.6-0.8 (`python scripts/bench_fp8_gemv.py --models
    llama-8b --m 1,16`)."""
    block_n, block_k = 64, 128
    tiles = triton.cdiv(n, block_n)
    split = 1
    while split < 8 and tiles * split * 2 <= SWAP_TARGET_PROGRAMS and k >= 4 * split * block_k:
        split *= 2
    return Fp8GemvConfig(block_n=block_n, block_k=block_k, split_k=split, num_stages=4,
                         swap_ab=True)  # fmt: skip


def row_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x[m, :]| as float32 [M]: one reduction kernel (the maxima a row-parallel layer
    reduces over its ranks before fp8_gemv)."""
    return torch.linalg.vector_norm(x, float("inf"), dim=-1, dtype=torch.float32)


def fp8_gemv(
    x: torch.Tensor,  # [M, K] bf16 / fp16, M <= 16, unit stride along K
    w: torch.Tensor,  # [N, K] float8_e4m3fn, unit stride along K; swiglu: [2I, K]
    w_scale: torch.Tensor,  # float32 [N] (contiguous): one scale per row of w
    input_scale: torch.Tensor | None = None,  # float32, one value: static activations
    *,
    amax: torch.Tensor | None = None,  # float32 [M]: dynamic with these row maxima (TP)
    config: Fp8GemvConfig | None = None,
    swiglu: bool = False,
    pdl: bool = False,  # launched with programmatic dependent launch (kernels/pdl.py)
) -> torch.Tensor:
    """sx * sw * (q(x) @ w.T): [M, N] in x's dtype; with swiglu, silu(gate) * up: [M, N / 2]."""
    m, k = x.shape
    n_rows, k_w = w.shape
    assert k == k_w and m <= MAX_M and x.stride(1) == 1 and w.stride(1) == 1
    assert w.dtype == torch.float8_e4m3fn and x.dtype in (torch.bfloat16, torch.float16)
    assert w_scale.dtype == torch.float32 and w_scale.shape == (n_rows,)
    assert w_scale.is_contiguous() and (not swiglu or n_rows % 2 == 0)
    assert input_scale is None or amax is None
    n = n_rows // 2 if swiglu else n_rows
    cfg = config or pick_config(m, n_rows, k)
    if swiglu and config is None and not cfg.swap_ab:  # a tile of each half: half the columns
        cfg = cfg._replace(block_n=max(16, cfg.block_n // 2))
    tile_bytes = (2 if swiglu else 1) * cfg.block_n * cfg.block_k
    while cfg.num_stages > 1 and tile_bytes * cfg.num_stages > SMEM_FOR_W:
        cfg = cfg._replace(num_stages=cfg.num_stages - 1)
    if cfg.swap_ab:
        return _swap(x, w, w_scale, input_scale, amax, cfg, swiglu, n, k, pdl)
    if input_scale is not None:
        mode, xs, stride_xs = SCALE_GIVEN, input_scale.reshape(-1)[:1], 0
    elif amax is not None or not cfg.amax_in_kernel:
        amax = row_amax(x) if amax is None else amax
        assert amax.dtype == torch.float32 and amax.shape == (m,)
        mode, xs, stride_xs = SCALE_FROM_AMAX, amax, amax.stride(0)
    else:
        mode, xs, stride_xs = SCALE_AMAX_IN_KERNEL, w_scale, 0  # xs unread
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(k, k_per_split)
    tiles = triton.cdiv(n, cfg.block_n)
    if tiles > NUM_COUNTERS:
        split_k, k_per_split = 1, k
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    counters = split_counters(x.device)
    ws = (
        y
        if split_k == 1
        else torch.empty(split_k * m * n_rows, dtype=torch.float32, device=x.device)
    )
    fma = cfg.fma and m == 1
    amax_m = triton.next_power_of_2(m)
    amax_k = min(max(AMAX_TILE // amax_m, 16), triton.next_power_of_2(k))
    _fp8_gemv_kernel[(tiles, split_k)](
        x, w, w_scale, xs, y, ws, counters, m, n, k, k_per_split, n * w.stride(0),
        x.stride(0), w.stride(0), y.stride(0), stride_xs,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split_k, SWIGLU=swiglu, SCALE=mode,
        AMAX_M=amax_m, AMAX_K=amax_k, FP8_DOT=cfg.fp8_dot, FMA=fma, ROWS=1 if fma else 16,
        HW_CAST=x.is_cuda,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch_kwargs(pdl, x),
    )  # fmt: skip
    return y


def _swap(x, w, w_scale, input_scale, amax, cfg: Fp8GemvConfig, swiglu: bool, n: int, k: int,
          pdl: bool) -> torch.Tensor:  # fmt: skip
    """fp8_gemv on _fp8_swap_kernel: x quantized by kernels/fp8_quant.py (its bytes and scales
    are quant_per_token's / quant_static's), then the kernel."""
    m = x.shape[0]
    if input_scale is not None:
        xq, sx = quant_static(x, input_scale)
    else:
        xq, sx = quant_per_token(x, None if amax is None else amax.reshape(-1, 1))
    sx = sx.reshape(-1)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(k, k_per_split)
    tiles = triton.cdiv(n, cfg.block_n)
    if tiles > NUM_COUNTERS:
        split_k, k_per_split = 1, k
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    counters = split_counters(x.device)
    ws = y if split_k == 1 else torch.empty(split_k * m * w.shape[0], dtype=torch.float32,
                                            device=x.device)  # fmt: skip
    _fp8_swap_kernel[(tiles, split_k)](
        xq, w, w_scale, sx, y, ws, counters, m, n, k, k_per_split, n * w.stride(0),
        xq.stride(0), w.stride(0), y.stride(0), sx.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split_k, SWIGLU=swiglu,
        PROMOTE=cfg.promote,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch_kwargs(pdl, x),
    )  # fmt: skip
    return y
