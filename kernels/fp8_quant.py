"""FP8 activation quantization in one kernel: x [M, K] (bf16 / fp16 / fp32) to float8_e4m3fn
[M, K] and float32 scales, each element of x read from memory once.

    xq, s = quant_per_token(x)               # s [M, 1]: max |x[m, :]| / 448
    xq, s = quant_per_token(x, amax)         # s from a given amax [M, 1] (reduced over TP ranks)
    xq, s = quant_per_token_group(x, 128)    # s [M, K / 128], column-major (strides (1, M))
    xq, s = quant_static(x, scale)           # the static per-tensor scale; s [M, 1] holds it

The arithmetic is batchrun/quant/act_quant.py's (the CPU's torch ops, the model of these
kernels) in float32: scale = max(amax * fp32(1 / 448), MIN_SCALE) (torch's division by a Python
scalar on CUDA), q = clamp(x / scale, -448, 448) (an IEEE division, div_rn) rounded to the
nearest even float8 value, so the kernels give the same bytes as the torch ops on CUDA. torch's
chain is five kernels (cast, abs, amax, div, clamp + cast) and reads x three times
(docs/benchmarks.md, Quantized models).

Per token, a program quantizes one row: the whole row in registers where it fits
(MAX_ROW_BLOCK columns), else in chunks read twice (the second read from L2). Per token group,
a program quantizes [BLOCK_M, group] tiles; its scales are written column-major because the
block matmul (kernels/fp8_block_matmul.py) reads a column of them per K step.

Every output is allocated by shape: the kernels run inside CUDA-graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchrun.kernels.pdl import pdl_launch_kwargs, pdl_wait

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
MIN_SCALE = 1e-12  # act_quant.MIN_SCALE: an all-zero row quantizes to zeros
MAX_ROW_BLOCK = 16384  # per token: a row of up to this many columns is read once

_DYNAMIC, _GIVEN_AMAX, _STATIC = 0, 1, 2


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
def _quantize(x, scale, ROUND: tl.constexpr):
    """x (fp32) / scale, clamped to the FP8 range (the cast to fp8 rounds to nearest even on the
    GPU). ROUND: rounded here (CPU tensors: Triton's interpreter casts to e4m3 by truncating)."""
    q = tl.math.div_rn(x, scale)
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if ROUND:
        q = _round_e4m3(q)
    return q


@triton.jit
def _scale_of(amax):
    # amax times fp32(1 / 448): torch's CUDA division by a Python scalar multiplies by its
    # reciprocal, so the scales equal act_quant's bit for bit (an IEEE division differs by an ulp
    # on some rows, and that ulp moves the ties of x / scale, frequent with bf16 x)
    return tl.maximum(amax * (1.0 / 448.0), 1e-12)


@triton.jit
def _quant_rows_kernel(
    X,
    Q,
    S,  # float32 [M]: the scale of each row, written
    SRC,  # float32: the static scale (one value) or the given amax [M]; unused when dynamic
    K,
    stride_xm,
    stride_qm,
    MODE: tl.constexpr,  # _DYNAMIC, _GIVEN_AMAX or _STATIC
    BLOCK_K: tl.constexpr,
    ONE_BLOCK: tl.constexpr,  # K <= BLOCK_K: the row is read once, into registers
    ROUND: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # x is the kernel before's output
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_xm
    q_row = Q + row * stride_qm
    offs = tl.arange(0, BLOCK_K)
    if MODE == 2:
        scale = tl.load(SRC)
    elif MODE == 1:
        scale = _scale_of(tl.load(SRC + row))
    if ONE_BLOCK:
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if MODE == 0:
            scale = _scale_of(tl.max(tl.abs(x), axis=0))
        tl.store(q_row + offs, _quantize(x, scale, ROUND).to(Q.dtype.element_ty), mask=mask)
    else:
        if MODE == 0:
            amax = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                mask = k0 + offs < K
                x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = _scale_of(tl.max(amax, axis=0))
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + offs < K
            x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(
                q_row + k0 + offs, _quantize(x, scale, ROUND).to(Q.dtype.element_ty), mask=mask
            )
    tl.store(S + row, scale)


@triton.jit
def _quant_groups_kernel(
    X,
    Q,
    S,
    M,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    stride_sg,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROUND: tl.constexpr,
    PDL: tl.constexpr,
):
    """One [BLOCK_M, GROUP] tile: the rows' maxima over the group's columns, their scales."""
    pdl_wait(PDL)  # x is the kernel before's output
    pid_m = tl.program_id(0)
    group = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    scale = _scale_of(tl.max(tl.abs(x), axis=1))  # [BLOCK_M]
    q = _quantize(x, scale[:, None], ROUND).to(Q.dtype.element_ty)
    tl.store(Q + rows64[:, None] * stride_qm + cols[None, :], q, mask=mask)
    tl.store(S + rows64 * stride_sm + group * stride_sg, scale, mask=rows < M)


def _rounds(x: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether the kernel rounds to e4m3 itself: CPU tensors (the interpreter) into float8."""
    return not x.is_cuda and out_dtype == FP8_DTYPE


def _rows(
    x: torch.Tensor, mode: int, src: torch.Tensor | None, out_dtype=FP8_DTYPE, pdl: bool = False
):
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [M, K] with unit stride along K"
    num_rows, cols = x.shape
    q = torch.empty((num_rows, cols), dtype=out_dtype, device=x.device)
    scale = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, scale
    one_block = cols <= MAX_ROW_BLOCK
    block = triton.next_power_of_2(cols) if one_block else 8192
    # NOTE: 32 fp32 values a thread: the row stays in registers without spilling
    num_warps = max(1, min(16, block // 1024))
    _quant_rows_kernel[(num_rows,)](
        x,
        q,
        scale,
        scale if src is None else src,
        cols,
        x.stride(0),
        q.stride(0),
        MODE=mode,
        BLOCK_K=block,
        ONE_BLOCK=one_block,
        ROUND=_rounds(x, out_dtype),
        num_warps=num_warps,
        **pdl_launch_kwargs(pdl, x),
    )
    return q, scale


def quant_per_token(
    x: torch.Tensor,
    amax: torch.Tensor | None = None,
    out_dtype: torch.dtype = FP8_DTYPE,
    pdl: bool = False,  # launched with programmatic dependent launch (kernels/pdl.py)
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as float8 [M, K] and float32 scales [M, 1] (torch._scaled_mm's row-wise
    operand). amax: float32 [M, 1], each row's maximum |x| taken over more columns than x holds
    (a row-parallel layer's, reduced over the ranks); None: x's own. out_dtype float32 keeps the
    rounded-to-range values before the FP8 cast (the tests' check of the arithmetic)."""
    if amax is None:
        return _rows(x, _DYNAMIC, None, out_dtype, pdl)
    return _rows(x, _GIVEN_AMAX, amax.reshape(-1).float().contiguous(), out_dtype, pdl)


def quant_static(
    x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = FP8_DTYPE, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as float8 with the per-tensor float32 `scale` (a scalar tensor), and that scale
    repeated per row, [M, 1] (a row-wise operand for per-channel weights)."""
    return _rows(x, _STATIC, scale.reshape(1).float(), out_dtype, pdl)


def quant_per_token_group(
    x: torch.Tensor, group: int = 128, out_dtype: torch.dtype = FP8_DTYPE, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as float8 [M, K] and float32 scales [M, ceil(K / group)], one per row and group
    of `group` columns, stored column-major (strides (1, M))."""
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [M, K] with unit stride along K"
    assert group & (group - 1) == 0, "the group size must be a power of two"
    num_rows, cols = x.shape
    num_groups = triton.cdiv(cols, group)
    q = torch.empty((num_rows, cols), dtype=out_dtype, device=x.device)
    scale = torch.empty((num_groups, num_rows), dtype=torch.float32, device=x.device).t()
    if num_rows == 0:
        return q, scale
    block_m = 8 if num_rows <= 64 else 32
    grid = (triton.cdiv(num_rows, block_m), num_groups)
    _quant_groups_kernel[grid](
        x,
        q,
        scale,
        num_rows,
        cols,
        x.stride(0),
        q.stride(0),
        scale.stride(0),
        scale.stride(1),
        GROUP=group,
        BLOCK_M=block_m,
        ROUND=_rounds(x, out_dtype),
        num_warps=4,
        **pdl_launch_kwargs(pdl, x),
    )
    return q, scale
