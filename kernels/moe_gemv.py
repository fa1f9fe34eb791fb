"""The experts of a mixture-of-experts decode batch as GEMVs: one program a routed row and column
tile, no alignment by expert and no top-k sum of its own, so the experts cost two launches where
kernels/fused_moe.py's grouped GEMMs take four (align, gate_up, down, sum).

    y[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, j]

    gate_up    grid (T * k, cdiv(I, GATE_N)): routed row r = t * k + j reads x[t] and the
               GATE_N gate rows and GATE_N up rows of w13[e]; silu(gate) * up (fp32, rounded
               once, as fused_moe's epilogue) to inter[r]                            [T * k, I]
    down       grid (T * k, cdiv(H, DOWN_N)): inter[r] @ w2[e]^T times topk_weights[r] (fp32),
               stored to plane j of an fp32 workspace [k, T, H]; the last of token t's k
               programs of a column tile to arrive (a counter per token and tile, as
               kernels/gemv.py's split-K) sums the k planes in slot order and writes y[t]

moe_gemv_residual also adds the residual stream in the down kernel's epilogue and, for one token,
normalizes the sum in the column tile that finishes last (kernels/gemv.py's gemv_residual does the
same for a dense matmul): a decoder layer's residual add after its experts and the next layer's
input norm cost no kernel (models/fused_decode.py, KernelPlan.decode_norms). With PDL
(kernels/pdl.py) gate_up waits first (its expert ids are the router's output, the kernel before)
and down loads its ids and first weight tile before its wait.

Each program streams its weight rows as kernels/gemv.py does at M = 1 (K tiles of 256 through
the pipelined shared-memory stages, x's one row padded to the tensor cores' 16 with zeros), the
recipe that reads llama-8b's decode matrices near the copy ceiling (docs/benchmarks.md, Kernels:
Decode GEMV).
The grid's first axis is the routed row, so the programs of one column tile run together and
rows routed to one expert read its tile from L2. The sum over a token's experts is in slot
order whatever program finishes last, and a row's result does not depend on the other rows of
the batch: graphs (which pad a step) and eager give the same bits.

Where it runs (`takes_gemv`): batches of at most MAX_ROWS routed rows, and no more routed rows
than experts, counted at fused_moe.tile_tokens(T) (the size a CUDA graph pads the step to, so
eager and graph take one path). Past that, rows routed to one expert share its weight tiles
better in the grouped GEMMs' blocks: the GEMVs win on Qwen3-30B-A3B (128 experts, top 8) from
1 to 8 tokens and on Mixtral (8 experts, top 2) up to 4, and lose at 8 (16 rows over 8 experts;
docs/benchmarks.md, Other architectures: MoE). gpt-oss's biases and clamped SwiGLU (`extras`)
are fused_moe's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from batchrun.kernels.fused_moe import _check_shapes, _swiglu, tile_tokens, unpack_extras
from batchrun.kernels.gemv import (
    NUM_COUNTERS,
    ROW_COUNTER,
    SMEM_FOR_W,
    ResidualStream,
    _mma,
    _norm_after_last_tile,
    _sum_planes,
    _w_tile,
    _write_y,
    _x_tile,
    split_counters,
)
from batchrun.kernels.pdl import pdl_launch_kwargs, pdl_wait

MAX_ROWS = 16  # routed rows (tile_tokens(T) * top_k) this path takes
TARGET_PROGRAMS = 256  # about two programs per SM of the H200's 132, as kernels/gemv.py aims


class MoeGemvConfig(NamedTuple):
    gate_n: int  # gate columns (and as many up columns) a gate_up program owns
    down_n: int  # output columns a down program owns
    block_k: int = 256
    num_warps: int = 4
    gate_stages: int = 3
    down_stages: int = 3


def takes_gemv(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether a batch of num_tokens tokens routed to top_k of num_experts experts runs here."""
    rows = tile_tokens(num_tokens) * top_k
    return num_tokens > 0 and rows <= min(MAX_ROWS, num_experts)


def pick_config(num_rows: int, hidden: int, inter: int, element_size: int) -> MoeGemvConfig:
    """Tiles for num_rows routed rows (tile_tokens(T) * k) of widths H, I: kernels/gemv.py's 256-
    wide K tiles (128 for 4-byte elements), columns halved from 32 (gate_up, each half) and 64
    (down) down to 16 while the grid has fewer than TARGET_PROGRAMS programs, and as many
    pipeline stages (up to 3) as kernels/gemv.py's shared-memory budget for weight tiles holds."""
    block_k = 256 if element_size <= 2 else 128
    gate_n, down_n = 32, 64
    while gate_n > 16 and num_rows * triton.cdiv(inter, gate_n) < TARGET_PROGRAMS:
        gate_n //= 2
    while down_n > 16 and num_rows * triton.cdiv(hidden, down_n) < TARGET_PROGRAMS:
        down_n //= 2

    def stages(tile_bytes: int) -> int:
        return max(1, min(3, SMEM_FOR_W // tile_bytes))

    return MoeGemvConfig(
        gate_n,
        down_n,
        block_k,
        gate_stages=stages(2 * gate_n * block_k * element_size),
        down_stages=stages(down_n * block_k * element_size),
    )


@triton.jit
def _gate_up_gemv_kernel(
    X,  # [T, H]
    W13,  # [E, 2I, H]
    Inter,  # [T * k, I]
    Ids,  # [T * k] the routed rows' experts
    B13,  # HAS_BIAS: [E, 2I] gate then up
    top_k,
    inter_size,  # I
    hidden,  # H: the K of this GEMV
    stride_xm,
    stride_we,
    stride_wn,
    stride_im,
    stride_be,
    alpha,  # CLAMP: gpt-oss's SwiGLU
    limit,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMP: tl.constexpr,
    GELU: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    token = (row // top_k).to(tl.int64)
    pdl_wait(PDL)  # the expert ids are the kernel before's (the router's) output
    expert = tl.load(Ids + row).to(tl.int64)
    offs_m = tl.arange(0, 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = offs_n[:, None] < inter_size
    g_rows = W13 + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    u_rows = g_rows + inter_size * stride_wn  # the up rows follow the gate rows
    x_row = X + token * stride_xm
    gate = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        x = _x_tile(x_row, offs_m, 1, stride_xm, k0, hidden, BLOCK_K)  # row 0, zeros below
        gate = _mma(gate, x, _w_tile(g_rows, in_n, k0, hidden, BLOCK_K), IEEE)
        up = _mma(up, x, _w_tile(u_rows, in_n, k0, hidden, BLOCK_K), IEEE)
    cols = tl.minimum(offs_n, inter_size - 1)
    h = _swiglu(gate, up, B13, expert, stride_be, cols, inter_size, alpha, limit, HAS_BIAS, CLAMP,
                GELU)  # fmt: skip
    out = Inter + row.to(tl.int64) * stride_im + offs_m[:, None] * 0 + offs_n[None, :]
    mask = (offs_m[:, None] == 0) & (offs_n < inter_size)[None, :]
    tl.store(out, h.to(Inter.dtype.element_ty), mask=mask)


@triton.jit
def _down_gemv_kernel(
    Inter,  # [T * k, I]
    W2,  # [E, H, I]
    Y,  # [T, H]
    WS,  # TOP_K > 1: fp32 [k, T, H], each slot's weighted rows
    Counters,  # int32, zero: one per (token, column tile), and kernels/gemv.py's row counter
    TopkWeights,  # float32 [T * k]
    Ids,  # [T * k]
    B2,  # HAS_BIAS: [E, H]
    R,  # ADD_RES: [T, H], the residual stream
    G,  # NORM_OUT: [H], the next norm's weight
    NormOut,  # NORM_OUT: [1, H]
    num_tokens,
    hidden,  # H: the N of this GEMV
    inter_size,  # I: its K
    stride_im,
    stride_we,
    stride_wn,
    stride_ym,
    stride_be,
    stride_rm,
    eps,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ADD_RES: tl.constexpr,
    NORM_OUT: tl.constexpr,  # one token: the last column tile normalizes y (kernels/gemv.py's)
    BLOCK_ROW: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    token = row // TOP_K
    slot = row % TOP_K
    # NOTE: the expert ids and the first weight tile are read before the PDL wait: the ids are
    # the router's output, two kernels back, and this kernel starts only once every program of
    # the gate_up kernel before it has passed its own wait, which returned when everything
    # launched before gate_up had finished (kernels/pdl.py: never two kernels ahead). So the
    # weight stream begins while gate_up drains
    expert = tl.load(Ids + row).to(tl.int64)
    offs_m = tl.arange(0, 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = offs_n[:, None] < hidden
    w_rows = W2 + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    a_row = Inter + row.to(tl.int64) * stride_im
    w = _w_tile(w_rows, in_n, 0, inter_size, BLOCK_K)
    pdl_wait(PDL)
    mask = (offs_m[:, None] == 0) & (offs_n < hidden)[None, :]
    res = tl.zeros((16, BLOCK_N), dtype=Y.dtype.element_ty)
    if ADD_RES:  # read now, where its latency hides behind the loop
        res_ptrs = R + token.to(tl.int64) * stride_rm + offs_m[:, None] * 0 + offs_n[None, :]
        res = tl.load(res_ptrs, mask=mask, other=0.0)
    acc = _mma(tl.zeros((16, BLOCK_N), dtype=tl.float32),
               _x_tile(a_row, offs_m, 1, stride_im, 0, inter_size, BLOCK_K), w, IEEE)  # fmt: skip
    for k0 in range(BLOCK_K, inter_size, BLOCK_K):
        a = _x_tile(a_row, offs_m, 1, stride_im, k0, inter_size, BLOCK_K)
        acc = _mma(acc, a, _w_tile(w_rows, in_n, k0, inter_size, BLOCK_K), IEEE)
    if HAS_BIAS:
        cols = tl.minimum(offs_n, hidden - 1)
        acc += tl.load(B2 + expert * stride_be + cols).to(tl.float32)[None, :]
    acc = acc * tl.load(TopkWeights + row)
    out = Y + token.to(tl.int64) * stride_ym + offs_m[:, None] * 0 + offs_n[None, :]
    dtype = Y.dtype.element_ty
    if TOP_K == 1:
        _write_y(acc, acc, out, mask, res, dtype, False, ADD_RES)
        if NORM_OUT:
            _norm_after_last_tile(Y, G, NormOut, Counters + ROW_COUNTER, hidden, eps,
                                  tl.num_programs(1), BLOCK_ROW)  # fmt: skip
    else:
        plane_stride = num_tokens * hidden
        plane_offs = token * hidden + offs_m[:, None] * 0 + offs_n[None, :]
        tl.store(WS + slot * plane_stride + plane_offs, acc, mask=mask)
        # NOTE: kernels/gemv.py's split-K protocol: every thread's stores, a CTA barrier, one
        # gpu-scope acq_rel atomic; the last of the token's k programs reads the planes from L2
        tl.debug_barrier()
        counter = Counters + token * tl.num_programs(1) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == TOP_K - 1:
            total = _sum_planes(WS, plane_offs, mask, plane_stride, TOP_K)
            _write_y(total, total, out, mask, res, dtype, False, ADD_RES)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next call
            if NORM_OUT:
                _norm_after_last_tile(Y, G, NormOut, Counters + ROW_COUNTER, hidden, eps,
                                      tl.num_programs(1), BLOCK_ROW)  # fmt: skip


def moe_gemv(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeGemvConfig | None = None,
    extras=None,
    *,
    pdl: bool = False,  # launched with programmatic dependent launch (kernels/pdl.py)
) -> torch.Tensor:
    """y [T, H] in x's dtype, as the module docstring says, for any T (`takes_gemv` says where
    it is the faster path); arguments as kernels/fused_moe.py's fused_moe. Run one call eagerly
    before capturing a CUDA graph (it may allocate kernels/gemv.py's counters)."""
    return _launch(x, w13, w2, topk_weights, topk_ids, config, extras, None, None, pdl)[0]


def moe_gemv_residual(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    residual: torch.Tensor,  # [T, H], x's dtype, unit stride along H; not written
    norm: tuple[torch.Tensor, float] | None = None,  # (weight [H], eps); one token only
    extras=None,
    *,
    pdl: bool = False,
) -> ResidualStream:
    """h = moe_gemv(...) + residual, rounded as torch's `moe(x) + residual`; with norm, also
    rmsnorm(h) * weight, computed by the down kernel's column tile that finishes last (as
    kernels/gemv.py's gemv_residual does): a decoder layer's residual add after its experts and
    the next layer's input norm cost no kernel of their own."""
    assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
    if norm is not None:
        weight, _ = norm
        assert x.shape[0] == 1, "the in-kernel norm takes one token (decode batch 1)"
        assert weight.shape == (x.shape[1],) and weight.dtype == x.dtype and weight.is_contiguous()
    return ResidualStream(
        *_launch(x, w13, w2, topk_weights, topk_ids, None, extras, residual, norm, pdl)
    )


def _launch(x, w13, w2, topk_weights, topk_ids, config, extras, residual, norm, pdl):
    """(y, normed): normed when norm is given, else None."""
    _check_shapes(x, w13, w2, topk_weights, topk_ids)
    b13, b2, alpha, limit, gelu = unpack_extras(extras, w13, w2)
    num_tokens, hidden = x.shape
    inter_size = w2.shape[2]
    top_k = topk_ids.shape[1]
    num_rows = num_tokens * top_k
    y = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    normed = None if norm is None else torch.empty_like(y)
    if num_tokens == 0:
        return y, normed
    c = config or pick_config(tile_tokens(num_tokens) * top_k, hidden, inter_size, x.element_size())
    down_tiles = triton.cdiv(hidden, c.down_n)
    assert num_tokens * down_tiles <= NUM_COUNTERS, "more (token, tile) pairs than counters"
    ids = topk_ids.reshape(-1)
    weights = topk_weights.reshape(-1).contiguous()
    inter = torch.empty((num_rows, inter_size), dtype=x.dtype, device=x.device)
    ws = y if top_k == 1 else torch.empty(num_rows * hidden, dtype=torch.float32, device=x.device)
    ieee = x.dtype == torch.float32
    launch = pdl_launch_kwargs(pdl, x)
    _gate_up_gemv_kernel[(num_rows, triton.cdiv(inter_size, c.gate_n))](
        x, w13, inter, ids, w13 if b13 is None else b13, top_k, inter_size, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        0 if b13 is None else b13.stride(0), alpha, limit,
        BLOCK_N=c.gate_n, BLOCK_K=c.block_k, HAS_BIAS=b13 is not None, CLAMP=limit > 0,
        GELU=gelu, IEEE=ieee, num_warps=c.num_warps, num_stages=c.gate_stages, **launch,
    )  # fmt: skip
    # NOTE: absent operands get y as a stand-in pointer: their constexpr flag prunes every access
    r = y if residual is None else residual
    norm_w, eps = (y, 0.0) if norm is None else norm
    _down_gemv_kernel[(num_rows, down_tiles)](
        inter, w2, y, ws, split_counters(x.device), weights, ids, w2 if b2 is None else b2,
        r, norm_w, y if normed is None else normed, num_tokens, hidden, inter_size,
        inter.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        0 if b2 is None else b2.stride(0), r.stride(0), eps,
        TOP_K=top_k, BLOCK_N=c.down_n, BLOCK_K=c.block_k, HAS_BIAS=b2 is not None,
        ADD_RES=residual is not None, NORM_OUT=norm is not None,
        BLOCK_ROW=triton.next_power_of_2(hidden) if norm is not None else 1,
        IEEE=ieee, num_warps=c.num_warps, num_stages=c.down_stages, **launch,
    )  # fmt: skip
    return y, normed
