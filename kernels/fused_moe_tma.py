"""kernels/fused_moe.py's grouped GEMMs with both operands read through TMA descriptors (MoeConfig
gather=True): the routed rows of x are gathered into the alignment's order first, so that every
block of BLOCK_M rows is a contiguous tile of one expert's rows, as a dense GEMM's A tiles are.

    gather     xs[p] = x[sorted_ids[p] // k] (zeros on the padding)            [S, H]
    gate_up    block b: xs[b] @ w13[e]^T through descriptors; fused_moe's SwiGLU epilogue to
               inter[p], in the aligned order                                     [S, I]
    down       inter[b] @ w2[e]^T through descriptors; fused_moe's epilogue (bias, top-k
               weight) scattered to out[sorted_ids[p]]                            [T * k, H]

The weights are read as 2-D descriptors over [E * 2I, H] and [E * H, I]: an expert's tile starts
at row e * 2I + n (its up rows I further), e * H + n. A tile whose rows pass the expert's (I or
H not a multiple of BLOCK_N) reads the next rows, whose columns the stores mask; reads past the
last row and the K dimension's end are zeros (the descriptors' bounds). The gathered copy of x
costs a write and a read of S * H elements beside the GEMMs' S * H * I products each.

Host-side descriptors (triton.tools.tensor_descriptor) encode the buffers' addresses when the
kernel launches, so the launch runs inside CUDA graphs, whose buffers stay put. Operands need
rows of whole 16-byte units (fused_moe.takes_descriptors); otherwise fused_moe runs its gathered-
by-row kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchrun.kernels.fused_moe import _store_weighted, _swiglu, _tile_of
from triton.tools.tensor_descriptor import TensorDescriptor

GATHER_ROWS = 16  # rows a program of the gather copies


@triton.jit
def _gather_kernel(
    X,  # [T, H]
    Xs,  # [S, H]: the aligned rows
    Slots,  # WRITE_SLOTS: int32 [T * k], where each routed row landed in Xs
    SortedIds,
    NumPadded,
    num_rows,
    top_k,
    hidden,
    stride_xm,
    stride_sm,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    WRITE_SLOTS: tl.constexpr,
):
    first = tl.program_id(0) * ROWS
    if first < tl.load(NumPadded):
        p = first + tl.arange(0, ROWS)
        rows = tl.load(SortedIds + p)
        valid = rows < num_rows
        if WRITE_SLOTS:
            tl.store(Slots + tl.where(valid, rows, 0), p, mask=valid)
        tokens = tl.where(valid, rows // top_k, 0).to(tl.int64)
        for h0 in range(0, hidden, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            in_h = (offs_h < hidden)[None, :]
            v = tl.load(X + tokens[:, None] * stride_xm + offs_h[None, :],
                        mask=valid[:, None] & in_h, other=0.0)  # fmt: skip
            tl.store(Xs + p.to(tl.int64)[:, None] * stride_sm + offs_h[None, :], v, mask=in_h)


@triton.jit
def _gate_up_tma_kernel(
    XsDesc,  # [S, H], blocks [BLOCK_M, BLOCK_K]
    W13Desc,  # [E * 2I, H], blocks [BLOCK_N, BLOCK_K]
    Inter,  # [S, I]: silu(gate) * up in the aligned order
    ExpertIds,
    NumPadded,
    inter_size,
    hidden,
    num_blocks,
    stride_im,
    B13,  # HAS_BIAS: [E, 2I]
    stride_be,
    alpha,
    limit,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMP: tl.constexpr,
    GELU: tl.constexpr,
):
    pid_m, pid_n = _tile_of(tl.program_id(0), num_blocks, tl.cdiv(inter_size, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M < tl.load(NumPadded):
        expert = tl.load(ExpertIds + pid_m).to(tl.int64)
        first = pid_m * BLOCK_M
        gate_row = (expert * 2 * inter_size + pid_n * BLOCK_N).to(tl.int32)
        up_row = gate_row + inter_size
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            a = XsDesc.load([first, k0])
            gate = tl.dot(a, W13Desc.load([gate_row, k0]).T, gate)
            up = tl.dot(a, W13Desc.load([up_row, k0]).T, up)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.minimum(offs_n, inter_size - 1).to(tl.int64)
        h = _swiglu(gate, up, B13, expert, stride_be, cols, inter_size, alpha, limit, HAS_BIAS,
                    CLAMP, GELU)  # fmt: skip
        offs_m = first + tl.arange(0, BLOCK_M)
        out_ptrs = Inter + offs_m.to(tl.int64)[:, None] * stride_im + offs_n[None, :]
        tl.store(out_ptrs, h.to(Inter.dtype.element_ty), mask=(offs_n < inter_size)[None, :])


@triton.jit
def _down_tma_kernel(
    InterDesc,  # [S, I], blocks [BLOCK_M, BLOCK_K]
    W2Desc,  # [E * H, I], blocks [BLOCK_N, BLOCK_K]
    Out,  # [T * k, H]
    TopkWeights,  # float32 [T * k]
    SortedIds,
    ExpertIds,
    NumPadded,
    num_rows,
    hidden,
    inter_size,
    num_blocks,
    stride_om,
    B2,  # HAS_BIAS: [E, H]
    stride_be,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid_m, pid_n = _tile_of(tl.program_id(0), num_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M < tl.load(NumPadded):
        expert = tl.load(ExpertIds + pid_m).to(tl.int64)
        first = pid_m * BLOCK_M
        w_row = (expert * hidden + pid_n * BLOCK_N).to(tl.int32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter_size, BLOCK_K):
            acc = tl.dot(InterDesc.load([first, k0]), W2Desc.load([w_row, k0]).T, acc)
        rows = tl.load(SortedIds + first + tl.arange(0, BLOCK_M))
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        _store_weighted(acc, Out, TopkWeights, B2, rows, num_rows, expert, stride_be, offs_n,
                        hidden, stride_om, HAS_BIAS)  # fmt: skip


def gather_rows(
    x: torch.Tensor,  # [T, H]
    xs: torch.Tensor,  # [S, H], S a multiple of GATHER_ROWS and of the alignment's rows
    slots: torch.Tensor | None,  # int32 [T * k]: each routed row's place in xs (None: not kept)
    align,  # kernels/moe_align.py's Alignment, its block a multiple of GATHER_ROWS
    num_rows: int,  # T * k
    top_k: int,
) -> None:
    """xs[p] = x[sorted_ids[p] // k] for the aligned rows p < num_padded (zeros on the padding);
    slots[r] = p for each routed row r where given."""
    hidden = x.shape[1]
    _gather_kernel[(xs.shape[0] // GATHER_ROWS,)](
        x, xs, xs if slots is None else slots, align.sorted_ids, align.num_padded, num_rows,
        top_k, hidden, x.stride(0), xs.stride(0), ROWS=GATHER_ROWS,
        BLOCK_H=min(512, triton.next_power_of_2(hidden)), WRITE_SLOTS=slots is not None,
    )  # fmt: skip


def gathered_experts(
    x: torch.Tensor,  # [T, H], this pass's tokens
    w13: torch.Tensor,  # [E, 2I, H], contiguous
    w2: torch.Tensor,  # [E, H, I], contiguous
    weights: torch.Tensor,  # float32 [T * k]
    align,  # kernels/moe_align.py's Alignment at config.block_m
    blocks: int,  # max_blocks(T * k, E, block_m): the grid's row blocks
    num_rows: int,  # T * k
    top_k: int,
    config,  # fused_moe.MoeConfig
    out: torch.Tensor,  # [>= T * k, H]: each routed row's weighted expert output
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    alpha: float,
    limit: float,
    gelu: bool = False,  # Gemma 4's GELU-tanh gate
) -> None:
    """fused_moe's gate_up and down for one pass, on the gathered rows (module docstring)."""
    num_experts, two_i, hidden = w13.shape
    inter_size = two_i // 2
    bm, g, d = config.block_m, config.gate_up, config.down
    rows_aligned = blocks * bm
    xs = torch.empty((rows_aligned, hidden), dtype=x.dtype, device=x.device)
    inter = torch.empty((rows_aligned, inter_size), dtype=x.dtype, device=x.device)
    gather_rows(x, xs, None, align, num_rows, top_k)
    w13_rows = w13.view(num_experts * two_i, hidden)
    _gate_up_tma_kernel[(blocks * triton.cdiv(inter_size, g.block_n),)](
        TensorDescriptor.from_tensor(xs, [bm, g.block_k]),
        TensorDescriptor.from_tensor(w13_rows, [g.block_n, g.block_k]),
        inter, align.expert_ids, align.num_padded, inter_size, hidden, blocks, inter.stride(0),
        w13 if b13 is None else b13, 0 if b13 is None else b13.stride(0), alpha, limit,
        BLOCK_M=bm, BLOCK_N=g.block_n, BLOCK_K=g.block_k, GROUP_M=g.group_m,
        HAS_BIAS=b13 is not None, CLAMP=limit > 0, GELU=gelu, num_warps=g.num_warps,
        num_stages=g.num_stages,
    )  # fmt: skip
    w2_rows = w2.view(num_experts * hidden, inter_size)
    _down_tma_kernel[(blocks * triton.cdiv(hidden, d.block_n),)](
        TensorDescriptor.from_tensor(inter, [bm, d.block_k]),
        TensorDescriptor.from_tensor(w2_rows, [d.block_n, d.block_k]),
        out, weights, align.sorted_ids, align.expert_ids, align.num_padded, num_rows, hidden,
        inter_size, blocks, out.stride(0), w2 if b2 is None else b2,
        0 if b2 is None else b2.stride(0),
        BLOCK_M=bm, BLOCK_N=d.block_n, BLOCK_K=d.block_k, GROUP_M=d.group_m,
        HAS_BIAS=b2 is not None, num_warps=d.num_warps, num_stages=d.num_stages,
    )  # fmt: skip
