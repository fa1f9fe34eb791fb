"""Attention with an output gate (Qwen3-Next, Qwen3.5): q_proj gives each head its query and a
gate of the same size (rows per head: [query | gate]); the attention's output times
sigmoid(gate) goes to o_proj. The gate rides with q from `project` to `attend`:

    project(x)  -> q [T, H, 2D] (query normed, gate), k, v [T, KV, D]
    attend(q, ..) -> attention of q[..., :D], times sigmoid(q[..., D:])  -> [T, H * D]
"""

from __future__ import annotations

import torch

from batchrun.layers.linear import ColumnParallelLinear
from batchrun.models.blocks.attention import Attention
from batchrun.models.blocks.context import BuildContext
from batchrun.parallel.partition import Run, ShardSpec


class GatedAttention(Attention):
    def __init__(self, ctx: BuildContext, layer_id: int, *, qk_norm: bool = True):
        super().__init__(ctx, layer_id, qk_norm=qk_norm)
        cfg, part = ctx.cfg, ctx.part
        d, q_full, kv_full = self.head_dim, 2 * cfg.q_size, cfg.kv_size
        q_len, kv_len, kv0 = 2 * part.q_size, part.kv_size, part.kv_head_start * d
        spec = ShardSpec(0, q_full + 2 * kv_full, (
            Run(part.head_start * 2 * d, 0, q_len),
            Run(q_full + kv0, q_len, kv_len),
            Run(q_full + kv_full + kv0, q_len + kv_len, kv_len),
        ))  # fmt: skip
        prefix = f"model.layers.{layer_id}.self_attn"
        rows = q_len + 2 * kv_len
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, spec, rows, bias=cfg.qkv_bias, dtype=ctx.dtype, device=ctx.device,
            kernels=ctx.kernels,
            quant=ctx.quant_plan(tuple(f"{prefix}.{n}_proj" for n in "qkv"), rows, cfg.hidden_size),
        )  # fmt: skip

    def split_heads(self, qkv: torch.Tensor):
        d, h = self.head_dim, self.num_heads
        qg, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.view(-1, h, 2 * d)
        q = self.q_norm(qg[..., :d].contiguous())
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, d))
        v = v.reshape(-1, self.num_kv_heads, d)
        return torch.cat([q, qg[..., d:]], dim=-1), k, v

    def attend(self, q, k, v, positions, rotary, backend, out=None) -> torch.Tensor:
        d = self.head_dim
        query, gate = q[..., :d].contiguous(), q[..., d:]
        o = super().attend(query, k.contiguous(), v.contiguous(), positions, rotary, backend)
        return o * torch.sigmoid(gate.reshape(o.shape))
