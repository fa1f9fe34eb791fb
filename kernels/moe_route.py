"""A mixture-of-experts router's softmax, top-k and renormalization in one kernel: the fp32
router logits [T, E] in, the routing weights [T, k] (float32) and expert ids [T, k] (int32) out,
one program a token (layers/moe.py's `route` is its definition, in four kernels).

    probs  = softmax(logits[t])                           fp32, max subtracted first
    ids    = the k largest probs, largest first; of equal probs the lower expert id first
    w      = probs[ids], divided by their sum if `renormalize`

Each token's result depends on its own row alone, so a CUDA graph's padding of the step (and
chunking) leaves every token's routing as the eager step computes it. At decode the router is a
chain of small launches (softmax, topk, sum, divide: four a layer, 192 for Qwen3-30B-A3B's 48
layers); this is one.

`route_gemv` is the whole router of a decode batch in one launch (the cast of x, the fp32 matmul
and the routing: three launches on the path above), for KernelPlan.moe_decode "gemv". It is
launched without PDL: an early launch behind o_proj's matmul with the norm in its last tile
(decode_norms "all") adds more to the decode chain than a launch after it, and behind the norm
kernel ("off") PDL changes nothing (docs/benchmarks.md, Other architectures: MoE).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchrun.kernels.gemv import split_counters


@triton.jit
def _route_row(logits, offs, Weights, Ids, row, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
               RENORMALIZE: tl.constexpr):  # fmt: skip
    """Softmax, top-k and renormalization of one token's logits (-inf past the experts), stored
    to its rows of Weights and Ids."""
    e = tl.exp(logits - tl.max(logits, axis=0))  # padding: exp(-inf) = 0
    probs = e / tl.sum(e, axis=0)
    offs_k = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(probs, axis=0, tie_break_left=True)
        weights = tl.where(offs_k == j, tl.max(probs, axis=0), weights)
        ids = tl.where(offs_k == j, best.to(tl.int32), ids)
        probs = tl.where(offs == best, -1.0, probs)  # below every probability: taken
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)  # the slots past TOP_K hold 0
    out = row * TOP_K + offs_k
    tl.store(Weights + out, weights, mask=offs_k < TOP_K)
    tl.store(Ids + out, ids, mask=offs_k < TOP_K)


@triton.jit
def _topk_softmax_kernel(
    Logits,  # fp32 [T, E]
    Weights,  # fp32 [T, TOP_K]
    Ids,  # int32 [T, TOP_K]
    num_experts,
    stride_l,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    logits = tl.load(Logits + row * stride_l + offs, mask=offs < num_experts, other=-float("inf"))
    _route_row(logits, offs, Weights, Ids, row, TOP_K, BLOCK_K, RENORMALIZE)


@triton.jit
def _router_tile(X, offs_m, M, stride_xm, offs_h, k_end, w, acc):
    """acc + x[:, offs_h] @ w.T in fp32 (x's rows past M and columns past k_end: zeros)."""
    mask = (offs_m[:, None] < M) & (offs_h < k_end)[None, :]
    x = tl.load(X + offs_m[:, None] * stride_xm + offs_h[None, :], mask=mask, other=0.0)
    return tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")


@triton.jit
def _route_gemv_kernel(
    X,  # [M, H] bf16 / fp16 / fp32, M <= 16
    W,  # fp32 [E, H]: the router
    B,  # HAS_BIAS: fp32 [E]
    Planes,  # fp32 [SPLIT_K, M, E]: each K slice's partial logits
    Counter,  # int32, zero (kernels/gemv.py's split counters: the first)
    Weights,  # fp32 [M, TOP_K]
    Ids,  # int32 [M, TOP_K]
    M,
    num_experts,
    hidden,
    k_per_split,
    stride_xm,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,  # experts a program
    BLOCK_H: tl.constexpr,  # K tile
    BLOCK_E: tl.constexpr,  # all experts, a power of two
    BLOCK_K: tl.constexpr,  # TOP_K's power of two
    BLOCK_S: tl.constexpr,  # the K slices' power of two
    RENORMALIZE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, hidden)
    own_e = offs_n[:, None] < num_experts  # this program's experts
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_H):
        offs_h = k0 + tl.arange(0, BLOCK_H)
        w = tl.load(w_rows + offs_h[None, :], mask=own_e & (offs_h < k_end)[None, :], other=0.0)
        acc = _router_tile(X, offs_m, M, stride_xm, offs_h, k_end, w, acc)
    plane_stride = M * num_experts
    offs_plane = offs_m[:, None] * num_experts + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < num_experts)
    tl.store(Planes + pid_k * plane_stride + offs_plane, acc, mask=mask)
    # NOTE: kernels/gemv.py's split-K protocol over the whole matmul (the softmax needs every
    # expert's logit): every thread's stores, a CTA barrier, one gpu-scope acq_rel atomic; the
    # last program to arrive reads all planes from L2 and routes every token
    tl.debug_barrier()
    arrived = tl.atomic_add(Counter, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
        offs = tl.arange(0, BLOCK_E)
        in_e = offs < num_experts
        bias = tl.zeros([BLOCK_E], dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(B + offs, mask=in_e, other=0.0)
        # every slice's partial logits of a row in one load (one L2 round trip, not one a
        # slice), summed by one reduction tree: the same sums every run
        offs_s = tl.arange(0, BLOCK_S)
        in_s = (offs_s < tl.num_programs(1))[:, None] & in_e[None, :]
        for row in range(0, M):
            planes = Planes + offs_s[:, None] * plane_stride + row * num_experts + offs[None, :]
            partials = tl.load(planes, mask=in_s, other=0.0, cache_modifier=".cg")
            logits = tl.where(in_e, tl.sum(partials, axis=0) + bias, -float("inf"))
            _route_row(logits, offs, Weights, Ids, row, TOP_K, BLOCK_K, RENORMALIZE)
        tl.atomic_xchg(Counter, 0, sem="relaxed", scope="gpu")  # ready for the next call


def topk_softmax(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int32) from fp32 router logits [T, E]."""
    assert logits.dtype == torch.float32 and logits.dim() == 2, (logits.dtype, logits.shape)
    assert logits.stride(-1) == 1, "unit stride along the experts"
    num_tokens, num_experts = logits.shape
    assert 0 < top_k <= num_experts, (top_k, num_experts)
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=logits.device)
    if num_tokens:
        _topk_softmax_kernel[(num_tokens,)](
            logits,
            weights,
            ids,
            num_experts,
            logits.stride(0),
            TOP_K=top_k,
            BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_K=triton.next_power_of_2(top_k),
            RENORMALIZE=renormalize,
            num_warps=1 if num_experts <= 64 else 2,
        )
    return weights, ids


ROUTE_GEMV_MAX_TOKENS = 16
ROUTE_GEMV_PROGRAMS = 128  # the router's fp32 weight (1 MB on Qwen3-30B-A3B) over ~one per SM


def route_gemv(
    x: torch.Tensor,  # [T, H], T <= 16, unit stride along H
    weight: torch.Tensor,  # fp32 [E, H]: the router, unit stride along H
    bias: torch.Tensor | None,  # fp32 [E] (gpt-oss) or None
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_softmax(x.float() @ weight.T + bias) for a decode batch in one launch: the fp32
    logits as split-K partial sums over the experts' tiles, then the last program to finish
    sums them in slice order and routes every token. A token's routing depends on its row
    alone. Run one call eagerly before capturing a CUDA graph (kernels/gemv.py's counters)."""
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    assert num_tokens <= ROUTE_GEMV_MAX_TOKENS and weight.shape == (num_experts, hidden)
    assert weight.dtype == torch.float32 and weight.stride(1) == 1 and x.stride(1) == 1
    assert bias is None or (bias.shape == (num_experts,) and bias.dtype == torch.float32)
    assert 0 < top_k <= num_experts, (top_k, num_experts)
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=x.device)
    if num_tokens == 0:
        return weights, ids
    block_n, block_h = 16, 128
    tiles = triton.cdiv(num_experts, block_n)
    split = max(1, min(triton.cdiv(hidden, block_h), ROUTE_GEMV_PROGRAMS // tiles))
    k_per_split = triton.cdiv(triton.cdiv(hidden, split), block_h) * block_h
    split = triton.cdiv(hidden, k_per_split)
    planes = torch.empty(split * num_tokens * num_experts, dtype=torch.float32, device=x.device)
    _route_gemv_kernel[(tiles, split)](
        x, weight, weights if bias is None else bias, planes, split_counters(x.device), weights,
        ids, num_tokens, num_experts, hidden, k_per_split, x.stride(0), weight.stride(0),
        HAS_BIAS=bias is not None, TOP_K=top_k, BLOCK_N=block_n, BLOCK_H=block_h,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_S=triton.next_power_of_2(split), RENORMALIZE=renormalize, num_warps=4,
    )  # fmt: skip
    return weights, ids
