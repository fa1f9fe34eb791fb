"""Attention over packed variable-length sequences with no KV pool and no padding: prefill-only
work (batchrun/pooling) and the encoders' blocks (models/blocks/encoder.py, modernbert.py).

    tokens   [T] = seq 0 | seq 1 | ... | seq B-1        cu_seqlens [B + 1]: where each begins

Each sequence attends over its own tokens only: causal for decoders, bidirectional for encoders.
On CUDA in fp16 / bf16 one call of torch's varlen_attn (FlashAttention over cu_seqlens, its
window as (left, right)) runs the whole step; elsewhere torch's scaled_dot_product_attention
runs per sequence, the reference that tests/gpu/test_pooling_gpu.py checks the GPU path against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: tuple[int, ...],
    scaling: float,
    causal: bool,
    half_window: int = 0,
    window: int = 0,
) -> torch.Tensor:
    """q [T, H, D], k and v [T, KV, D] packed by `seq_lens` -> [T, H * D]. `half_window` > 0
    (bidirectional): each query sees the keys at most that many positions away; `window` > 0
    (causal): the query at p sees the keys p - window < k <= p (attention/base.py's rule)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return _flash_varlen(q, k, v, seq_lens, scaling, causal, half_window, window)
    num_heads, num_kv = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    start = 0
    for n in seq_lens:
        sl = slice(start, start + n)
        qs, ks, vs = (t[sl].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        if num_kv != num_heads:
            ks = ks.repeat_interleave(num_heads // num_kv, dim=0)
            vs = vs.repeat_interleave(num_heads // num_kv, dim=0)
        mask, is_causal = None, causal
        pos = torch.arange(n, device=q.device)
        dist = pos[:, None] - pos[None, :]  # [n, n] query - key
        if half_window and n > half_window:
            mask = dist.abs() <= half_window
        elif window and n > window:
            mask, is_causal = (dist >= 0) & (dist < window), False
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=is_causal, scale=scaling
        )
        out[sl] = o.transpose(0, 1)
        start += n
    return out.reshape(q.shape[0], -1)


def _flash_varlen(q, k, v, seq_lens, scaling, causal, half_window, window) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    # (left, right): -1 is unbounded; a causal window W sees the W - 1 keys before the query
    if half_window:
        bounds = (half_window, half_window)
    elif causal:
        bounds = (window - 1 if window else -1, 0)
    else:
        bounds = (-1, -1)
    cu = torch.tensor((0, *seq_lens), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu = cu.pin_memory().to(q.device, non_blocking=True)
    longest = max(seq_lens)
    if k.shape[1] != q.shape[1]:  # GQA: each KV head serves a group of query heads
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, window_size=bounds)
    return out.reshape(q.shape[0], -1)
