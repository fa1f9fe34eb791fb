"""Skinny FP8 matmul for decode: y[M, N] = sx[m] * sw[n] * (q(x)[M, K] @ w[N, K]^T) for M <= 16,
the weight float8_e4m3fn with one float32 scale per output row (a per-tensor scale broadcast),
the activations quantized per token first by kernels/fp8_quant.py (its bytes and scales are
batchrun/quant/act_quant.py's torch ops on CUDA, as torch._scaled_mm's path quantizes):

    q(x) = x / sx[m] clamped to +-448, rounded to e4m3 (to nearest even)
    sx[m] = max(max |x[m, :]| * fp32(1 / 448), 1e-12)   dynamic
    sx[m] = the checkpoint's input_scale                 static

The matmul puts the weight on the tensor cores' M side: a program streams [BLOCK_N, BLOCK_K]
tiles of w through the compiler's pipelined shared-memory stages into e4m3 wgmma, against q(x)'s
rows padded to 16 on the N side (w @ q(x)^T, then the [BLOCK_N, 16] sums transposed once). With
x on the M side (padded to 16 rows, as kernels/gemv.py runs bf16) Sm90 has no e4m3 MMA for that
shape and the dot falls back to conversions (in-kernel quantization with fp32 multiply-adds
reads the weights at about half this kernel's rate). q(x) comes from kernels/fp8_quant.py's
kernel before the matmul: quantizing each x tile in registers inside the loop, before its e4m3
dot (the same bytes), doubles the decode step. Leaving x unquantized (W8A16: the e4m3 tile
converted to bf16 in registers) loses too: the conversion is two instructions a value, slower
through the compiler's pipeline and in a Gluon kernel whose 16-byte loads are the MMA's register
fragments (docs/benchmarks.md, Quantized models: every figure of this paragraph).

Products of e4m3 values are exact in fp32. Each K tile's dot starts from zeros and is added to
the fp32 sums: the tensor cores' e4m3 accumulator keeps fewer bits than fp32, so it spans one
tile, as torch._scaled_mm's non-fast accumulation promotes. The scales apply after
the sum, as ((acc * sw) * sx), the order of torch's row-wise scaled matmul epilogue, and y is
rounded once to x's dtype.

Everything else is kernels/gemv.py's, whose helpers this reuses: a program owns BLOCK_N output
rows of w and, with SPLIT_K > 1, one K slice of them; split-K reduces in the kernel (fp32 planes
summed in slice order by the last slice, the shared per-device counters); the weight scales and
a slice's first two weight tiles load before the PDL wait; with swiglu, w is the fused [2I, K]
gate_up weight (scales [2I]) and y = silu(gate) * up, [M, I], gate and up each rounded to the
dtype first as the unfused path rounds them.

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
from batchrun.kernels.fp8_quant import quant_per_token, quant_per_token_group, quant_static
from batchrun.kernels.gemv import (
    MAX_M,
    NUM_COUNTERS,
    SMEM_FOR_W,
    SplitRule,
    _sum_planes,
    _w_tile,
    _write_y,
    _x_tile,
    split_counters,
    split_k_for,
)
from batchrun.kernels.pdl import pdl_launch_kwargs, pdl_wait

BLOCK = 128  # block FP8's weight blocks and activation groups
# splits along K up to 512 programs, at most 8 slices of at least two K tiles
SPLIT = SplitRule(target_programs=512, max_split=8, min_tiles=2)


class Fp8GemvConfig(NamedTuple):
    block_n: int = 64  # weight rows a program (the MMA's M side: 64 or more)
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _fp8_gemv_kernel(
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
    stride_xsk,  # BLOCKS: XS [M, K / 128], a group's column
    stride_swn,  # BLOCKS: SW [N / 128, K / 128], a block row's
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCKS: tl.constexpr,  # 128 x 128 weight blocks, activations per 128-column group
    PDL: tl.constexpr,
):
    """y from q(x) (e4m3 [M, K], its rows' scales XS) and w: BLOCK_N rows of w a program. With
    BLOCKS, each K tile is one 128-column group (BLOCK_K 128): its dot is scaled by the block's
    weight scale and the group's activation scales before it is added."""
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
    if BLOCKS:  # scaled a tile at a time: nothing left for the epilogue
        sw = tl.full([BLOCK_N], 1.0, tl.float32)
        sw_up = sw
        sw_rows = SW + (offs_n // 128) * stride_swn
        sw_up_rows = SW + ((offs_n + N) // 128) * stride_swn
    else:
        sw_rows = SW  # unused: the epilogue scales
        sw_up_rows = SW
        sw = tl.load(SW + offs_n, mask=offs_n < N, other=0.0)
        sw_up = sw
        if SWIGLU:
            sw_up = tl.load(SW + N + offs_n, mask=offs_n < N, other=0.0)
    # NOTE: the first two weight tiles are peeled off the loop so that their loads come before
    # the PDL wait, as kernels/gemv.py's: the weights are no earlier kernel's output, so their
    # HBM latency overlaps the kernel before (the activations' quantization); q(x) is read after
    # the wait. A slice of one tile gets a second of zeros (adding 0 keeps its sums' bits)
    w = _w_tile(w_rows, in_n, k_start, k_end, BLOCK_K)
    w2 = _w_tile(w_rows, in_n, k_start + BLOCK_K, k_end, BLOCK_K)
    w_up, w2_up = w, w2
    if SWIGLU:
        w_up = _w_tile(up_rows, in_n, k_start, k_end, BLOCK_K)
        w2_up = _w_tile(up_rows, in_n, k_start + BLOCK_K, k_end, BLOCK_K)
    pdl_wait(PDL)
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    acc, acc_up = _tile_step(acc, acc_up, w, w_up, k_start, k_end, XQ, XS, sw_rows, sw_up_rows,
                             offs_m, offs_n, in_m, M, N, stride_xm, stride_xs, stride_xsk,
                             BLOCK_K, SWIGLU, BLOCKS)  # fmt: skip
    acc, acc_up = _tile_step(acc, acc_up, w2, w2_up, k_start + BLOCK_K, k_end, XQ, XS, sw_rows,
                             sw_up_rows, offs_m, offs_n, in_m, M, N, stride_xm, stride_xs,
                             stride_xsk, BLOCK_K, SWIGLU, BLOCKS)  # fmt: skip
    for k0 in range(k_start + 2 * BLOCK_K, k_end, BLOCK_K):
        w = _w_tile(w_rows, in_n, k0, k_end, BLOCK_K)
        w_up = w
        if SWIGLU:
            w_up = _w_tile(up_rows, in_n, k0, k_end, BLOCK_K)
        acc, acc_up = _tile_step(acc, acc_up, w, w_up, k0, k_end, XQ, XS, sw_rows, sw_up_rows,
                                 offs_m, offs_n, in_m, M, N, stride_xm, stride_xs, stride_xsk,
                                 BLOCK_K, SWIGLU, BLOCKS)  # fmt: skip
    if BLOCKS:
        sx = tl.full([16], 1.0, tl.float32)
    else:
        sx = tl.load(XS + offs_m * stride_xs, mask=in_m, other=1.0)
    _finish(tl.trans(acc), tl.trans(acc_up), sx, sw, sw_up, Y, WS, Counters, offs_m, offs_n,
            M, N, stride_ym, pid_n, pid_k, SPLIT_K, SWIGLU)  # fmt: skip


@triton.jit
def _tile_step(acc, acc_up, w, w_up, k0, k_end, XQ, XS, sw_rows, sw_up_rows, offs_m, offs_n, in_m,
               M, N, stride_xm, stride_xs, stride_xsk, BLOCK_K: tl.constexpr,
               SWIGLU: tl.constexpr, BLOCKS: tl.constexpr):  # fmt: skip
    """The sums acc [BLOCK_N, 16] (and acc_up) plus the K tile at k0: w (and w_up) loaded, q(x)'s
    tile read here. Each tile's dot starts from zeros and is added in fp32: the e4m3 MMA's
    accumulator spans one tile. With BLOCKS the dot is scaled by its block's weight scale and
    its group's activation scales first."""
    xq = _x_tile(XQ, offs_m, M, stride_xm, k0, k_end, BLOCK_K)
    d = tl.dot(w, tl.trans(xq))
    if BLOCKS:
        # a slice's zero tile past its end takes its last group's (finite) scales: 0 all the same
        kb = tl.minimum(k0, k_end - 1) // 128
        sx_k = tl.load(XS + offs_m * stride_xs + kb * stride_xsk, mask=in_m, other=0.0)
        sw_k = tl.load(sw_rows + kb, mask=offs_n < N, other=0.0)
        d = d * sw_k[:, None] * sx_k[None, :]
    acc = acc + d
    if SWIGLU:
        d_up = tl.dot(w_up, tl.trans(xq))
        if BLOCKS:
            sw_k = tl.load(sw_up_rows + kb, mask=offs_n < N, other=0.0)
            d_up = d_up * sw_k[:, None] * sx_k[None, :]
        acc_up = acc_up + d_up
    return acc, acc_up


@triton.jit
def _finish(acc, acc_up, sx, sw, sw_up, Y, WS, Counters, offs_m, offs_n, M, N, stride_ym, pid_n,
            pid_k, SPLIT_K: tl.constexpr, SWIGLU: tl.constexpr):  # fmt: skip
    """y from a program's fp32 sums acc [16, BLOCK_N] (and acc_up): written scaled, or with
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
    """y from the fp32 sums: (acc * sw) * sx, then kernels/gemv.py's writer (the SwiGLU gate
    rounded as the unfused path rounds)."""
    y = (acc * sw[None, :]) * sx[:, None]
    up = y
    if SWIGLU:
        up = (acc_up * sw_up[None, :]) * sx[:, None]
    _write_y(y, up, out, mask, y, dtype, SWIGLU, False)  # (no residual: y stands in)


def pick_config(m: int, n: int, k: int) -> Fp8GemvConfig:
    """64-row x 128-wide tiles, split along K by SPLIT; the sweep's best tiles are within a few
    percent of it (docs/benchmarks.md, Quantized models)."""
    del m  # one rule for every decode batch: w is read once whatever M is
    block_n, block_k = 64, 128
    split = split_k_for(triton.cdiv(n, block_n), k, block_k, SPLIT)
    return Fp8GemvConfig(block_n=block_n, block_k=block_k, split_k=split)


def row_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x[m, :]| as float32 [M]: one reduction kernel (the maxima a row-parallel layer
    reduces over its ranks before fp8_gemv)."""
    return torch.linalg.vector_norm(x, float("inf"), dim=-1, dtype=torch.float32)


def fp8_gemv(
    x: torch.Tensor,  # [M, K] bf16 / fp16, M <= 16, unit stride along K
    w: torch.Tensor,  # [N, K] float8_e4m3fn, unit stride along K; swiglu: [2I, K]
    w_scale: torch.Tensor,  # float32 [N] (contiguous): one scale per row of w; blocks: 2-D
    input_scale: torch.Tensor | None = None,  # float32, one value: static activations
    *,
    amax: torch.Tensor | None = None,  # float32 [M]: dynamic with these row maxima (TP)
    blocks: bool = False,  # w_scale [N / 128, K / 128] per block, x quantized per 128 columns
    config: Fp8GemvConfig | None = None,
    swiglu: bool = False,
    pdl: bool = False,  # launched with programmatic dependent launch (kernels/pdl.py)
) -> torch.Tensor:
    """sx * sw * (q(x) @ w.T): [M, N] in x's dtype; with swiglu, silu(gate) * up: [M, N / 2].
    blocks: the sum over K's 128-column groups of each group's dot times its scales."""
    return _launch(x, w, w_scale, input_scale, amax, blocks, config, swiglu, pdl)


def _launch(x, w, w_scale, input_scale, amax, blocks, config, swiglu, pdl) -> torch.Tensor:
    m, k = x.shape
    n_rows, k_w = w.shape
    assert k == k_w and m <= MAX_M and x.stride(1) == 1 and w.stride(1) == 1
    assert w.dtype == torch.float8_e4m3fn and x.dtype in (torch.bfloat16, torch.float16)
    assert w_scale.dtype == torch.float32 and (not swiglu or n_rows % 2 == 0)
    assert input_scale is None or amax is None
    assert amax is None or (amax.dtype == torch.float32 and amax.shape == (m,))
    n = n_rows // 2 if swiglu else n_rows
    if blocks:
        assert input_scale is None and amax is None, "block FP8 quantizes x per 128 columns"
        assert w_scale.shape == (triton.cdiv(n_rows, BLOCK), triton.cdiv(k, BLOCK))
        assert w_scale.stride(1) == 1 and (not swiglu or n % BLOCK == 0), "gate / up blocks"
    else:
        assert w_scale.shape == (n_rows,) and w_scale.is_contiguous()
    cfg = config or pick_config(m, n_rows, k)
    if blocks:  # one group a K tile, inside one block row
        assert cfg.block_k == BLOCK and BLOCK % cfg.block_n == 0, cfg
    tile_bytes = (2 if swiglu else 1) * cfg.block_n * cfg.block_k
    while cfg.num_stages > 1 and tile_bytes * cfg.num_stages > SMEM_FOR_W:
        cfg = cfg._replace(num_stages=cfg.num_stages - 1)
    if blocks:
        xq, sx = quant_per_token_group(x, BLOCK, pdl=pdl)  # sx [M, K / 128]
        stride_xs, stride_xsk, stride_swn = sx.stride(0), sx.stride(1), w_scale.stride(0)
    else:
        if input_scale is not None:
            xq, sx = quant_static(x, input_scale, pdl=pdl)
        else:
            xq, sx = quant_per_token(x, None if amax is None else amax.reshape(-1, 1), pdl=pdl)
        sx = sx.reshape(-1)
        stride_xs, stride_xsk, stride_swn = sx.stride(0), 0, 0
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(k, k_per_split)
    tiles = triton.cdiv(n, cfg.block_n)
    if tiles > NUM_COUNTERS:
        split_k, k_per_split = 1, k
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    counters = split_counters(x.device)
    ws = y if split_k == 1 else torch.empty(split_k * m * n_rows, dtype=torch.float32,
                                            device=x.device)  # fmt: skip
    _fp8_gemv_kernel[(tiles, split_k)](
        xq, w, w_scale, sx, y, ws, counters, m, n, k, k_per_split, n * w.stride(0), xq.stride(0),
        w.stride(0), y.stride(0), stride_xs, stride_xsk, stride_swn,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split_k, SWIGLU=swiglu, BLOCKS=blocks,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch_kwargs(pdl, x),
    )  # fmt: skip
    return y
