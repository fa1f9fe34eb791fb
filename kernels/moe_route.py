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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
