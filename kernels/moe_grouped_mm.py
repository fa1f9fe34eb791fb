"""The experts of a mixture-of-experts layer at prefill sizes on torch._grouped_mm, the grouped
GEMM of torch's CUDA build (CUTLASS's on sm_90), with Triton kernels for what it does not do;
no host sync, so a step runs inside a CUDA graph:

    align      kernels/moe_align.py at ALIGN_M rows, with each expert's group end (`ends`: the
               grouped GEMMs' offsets)
    gather     xs[p] = x[sorted_ids[p] // k] (zeros on the padding), and slots[r] = p, where
               routed row r landed (kernels/fused_moe_tma.py's gather)              [S, H]
    gate_up    h = grouped_mm(xs, w13[e]^T) over each expert's rows                  [S, 2I]
    swiglu     inter[p] = silu(h[p, :I]) * h[p, I:] in fp32 (gpt-oss: its biases and clamped
               SwiGLU, fused_moe's epilogue)                                          [S, I]
    down       o = grouped_mm(inter, w2[e]^T)                                          [S, H]
    combine    y[t] = sum_j topk_weights[t, j] * (o[slots[t k + j]] (+ b2[e])) in fp32,
               rounded once                                                           [T, H]

Beside kernels/fused_moe.py's Triton grouped GEMMs, which fuse the SwiGLU into gate_up's epilogue
and the top-k weights into down's, this writes and reads h and o once more (S * (2I + H)
elements each way); the library's GEMMs are what pays: Qwen3-30B-A3B's experts run faster than
on the Triton GEMMs from 256 rows an expert, the gather, SwiGLU and sum taking most of the time
the grouped GEMMs leave (docs/benchmarks.md, Other architectures: MoE).

The buffers are sized by shape: S from tile_tokens(T) (kernels/fused_moe.py), so a step padded to
a graph's size runs the grouped GEMMs at the shapes its eager run does (torch picks the CUTLASS
tiles from the operands' shapes; a row's sums depend on the tiles, not on its neighbours), and a
pass holds at most MAX_H_ELEMENTS of h (`tokens_per_pass`), which bounds the wide experts' buffers
(Mixtral's 2I = 28,672: 1,024 tokens a pass).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchrun.kernels.fused_moe import (
    _check_shapes,
    _swiglu,
    tile_tokens,
    unpack_extras,
)
from batchrun.kernels.fused_moe import tokens_per_pass as fused_tokens_per_pass
from batchrun.kernels.fused_moe_tma import GATHER_ROWS, gather_rows
from batchrun.kernels.moe_align import align_by_expert, max_blocks

MIN_ROWS_PER_EXPERT = 32  # takes_grouped_mm: batches past this many routed rows an expert
ALIGN_M = 16  # rows each expert's group is padded to: a multiple of GATHER_ROWS
MAX_H_ELEMENTS = 1 << 26  # h's elements a pass holds (128 MiB in bf16)


def tokens_per_pass(top_k: int, intermediate: int) -> int:
    """The tokens one pass runs: fused_moe's passes (at most its MAX_CHUNK_ROWS routed rows, a
    multiple of TILE_STEP), shortened to hold at most MAX_H_ELEMENTS of h."""
    return fused_tokens_per_pass(top_k, MAX_H_ELEMENTS // (2 * intermediate))


def takes_grouped_mm(
    num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int
) -> bool:
    """Whether a batch of T = num_tokens runs here (KernelPlan.moe_prefill "grouped_mm"): past
    MIN_ROWS_PER_EXPERT routed rows an expert, counted at tile_tokens(T) (a step padded to a
    graph's size decides as its eager run does), in passes no shorter than fused_moe's (each pass
    reads every expert's weights: wide experts, whose h bounds the pass, stay on fused_moe's
    longer passes), with rows of H and I elements in whole 16-byte units (the grouped GEMM's
    operand alignment, for 2-byte elements)."""
    grouped_pass = tokens_per_pass(top_k, intermediate)
    tokens = tile_tokens(min(num_tokens, grouped_pass))
    aligned = hidden % 8 == 0 and intermediate % 8 == 0
    return (
        aligned
        and tokens * top_k > MIN_ROWS_PER_EXPERT * num_experts
        and grouped_pass >= min(num_tokens, fused_tokens_per_pass(top_k))
    )


@triton.jit
def _swiglu_kernel(
    H,  # [S, 2I]: gate_up's output, each row's gate then up
    Inter,  # [S, I]
    ExpertIds,  # int32 [S / ALIGN_M]
    NumPadded,
    inter_size,
    stride_hm,
    stride_im,
    B13,  # HAS_BIAS: [E, 2I]
    stride_be,
    alpha,
    limit,
    ROWS: tl.constexpr,
    ALIGN_M: tl.constexpr,
    BLOCK_I: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMP: tl.constexpr,
    GELU: tl.constexpr,
):
    first = tl.program_id(0) * ROWS
    if first < tl.load(NumPadded):
        expert = tl.load(ExpertIds + first // ALIGN_M).to(tl.int64)  # ROWS divides ALIGN_M
        p = (first + tl.arange(0, ROWS)).to(tl.int64)
        for i0 in range(0, inter_size, BLOCK_I):
            cols = i0 + tl.arange(0, BLOCK_I)
            mask = (cols < inter_size)[None, :]
            ptrs = H + p[:, None] * stride_hm + cols[None, :]
            gate = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(ptrs + inter_size, mask=mask, other=0.0).to(tl.float32)
            cols_in = tl.minimum(cols, inter_size - 1).to(tl.int64)
            a = _swiglu(gate, up, B13, expert, stride_be, cols_in, inter_size, alpha, limit,
                        HAS_BIAS, CLAMP, GELU)  # fmt: skip
            out_ptrs = Inter + p[:, None] * stride_im + cols[None, :]
            tl.store(out_ptrs, a.to(Inter.dtype.element_ty), mask=mask)


@triton.jit
def _combine_kernel(
    Down,  # [S, H]: down's output in the aligned order
    Y,  # [T, H]
    Slots,  # int32 [T * k]
    TopkWeights,  # float32 [T * k]
    TopkIds,  # [T * k] (HAS_BIAS: the bias's expert)
    hidden,
    stride_om,
    stride_ym,
    B2,  # HAS_BIAS: [E, H]
    stride_be,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    for h0 in range(0, hidden, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = cols < hidden
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            p = tl.load(Slots + t * TOP_K + j).to(tl.int64)
            v = tl.load(Down + p * stride_om + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                expert = tl.load(TopkIds + t * TOP_K + j).to(tl.int64)
                v += tl.load(B2 + expert * stride_be + cols, mask=mask, other=0.0).to(tl.float32)
            acc += v * tl.load(TopkWeights + t * TOP_K + j)
        tl.store(Y + t * stride_ym + cols, acc.to(Y.dtype.element_ty), mask=mask)


def _experts_pass(x, w13, w2, weights, topk_ids, y, b13, b2, alpha, limit, gelu) -> None:
    """One pass over x [T, H]'s tokens into y [T, H] (the module docstring's steps)."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter_size, top_k = two_i // 2, topk_ids.shape[1]
    num_rows = num_tokens * top_k
    align = align_by_expert(topk_ids, num_experts, ALIGN_M, ends=True)
    rows = max_blocks(tile_tokens(num_tokens) * top_k, num_experts, ALIGN_M) * ALIGN_M
    xs = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    slots = torch.empty(num_rows, dtype=torch.int32, device=x.device)
    gather_rows(x, xs, slots, align, num_rows, top_k)
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=align.ends)
    inter = torch.empty((rows, inter_size), dtype=x.dtype, device=x.device)
    _swiglu_kernel[(rows // GATHER_ROWS,)](
        h, inter, align.expert_ids, align.num_padded, inter_size, h.stride(0), inter.stride(0),
        w13 if b13 is None else b13, 0 if b13 is None else b13.stride(0), alpha, limit,
        ROWS=GATHER_ROWS, ALIGN_M=ALIGN_M, BLOCK_I=min(256, triton.next_power_of_2(inter_size)),
        HAS_BIAS=b13 is not None, CLAMP=limit > 0, GELU=gelu,
    )  # fmt: skip
    o = torch._grouped_mm(inter, w2.transpose(1, 2), offs=align.ends)
    _combine_kernel[(num_tokens,)](
        o, y, slots, weights, topk_ids, hidden, o.stride(0), y.stride(0),
        w2 if b2 is None else b2, 0 if b2 is None else b2.stride(0), TOP_K=top_k,
        BLOCK_H=min(1024, triton.next_power_of_2(hidden)), HAS_BIAS=b2 is not None,
    )  # fmt: skip


def grouped_mm_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    extras=None,
) -> torch.Tensor:
    """y [T, H] in x's dtype, as kernels/fused_moe.py's fused_moe computes it (x [T, H]; w13
    [E, 2I, H] gate rows then up rows, contiguous; w2 [E, H, I], contiguous; topk_weights
    [T, k] float32; topk_ids [T, k] int32 / int64; `extras` gpt-oss's biases and clamped
    SwiGLU), the experts' matmuls on torch._grouped_mm."""
    _check_shapes(x, w13, w2, topk_weights, topk_ids)
    assert w13.is_contiguous() and w2.is_contiguous(), "contiguous expert weights"
    b13, b2, alpha, limit, gelu = unpack_extras(extras, w13, w2)
    num_tokens = x.shape[0]
    y = torch.empty_like(x)
    chunk = tokens_per_pass(topk_ids.shape[1], w2.shape[2])
    weights = topk_weights.contiguous()
    ids = topk_ids.contiguous()
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        _experts_pass(x[start:end], w13, w2, weights[start:end].view(-1), ids[start:end],
                      y[start:end], b13, b2, alpha, limit, gelu)  # fmt: skip
    return y
