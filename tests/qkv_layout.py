"""The fused qkv projection's layout, for kernel tests of both tiers."""

from __future__ import annotations

import torch


def qkv_views(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """Strided q [T, H, D], k and v [T, KV, D] views of a fused qkv tensor, as llama.py's."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    num_tokens = qkv.shape[0]
    return (
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )
