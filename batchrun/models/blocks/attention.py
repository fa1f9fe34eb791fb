"""The attention block: fused qkv projection, optional q/k norm, rotary and attention by the
backend (full context or a sliding window, optional sink logits), o_proj.

    project(x)                   -> q [T, H, D], k, v [T, KV, D]   (q/k norm applied)
    attend(q, k, v, ...)         -> [T, H * D]   rotary, then attention over the paged KV
    o_proj(out)                  -> [T, hidden]

The block reads and writes the KV of `layer_id` in the pool (at `kv_layer`, its index among the
layers that write KV: ModelConfig.kv_layers); its window, scaling, q/k norms and
sinks are its own, so layers of one model may differ in them.
"""

from __future__ import annotations

import torch
from torch import nn

from batchrun.attention.base import AttentionBackend
from batchrun.layers.linear import ColumnParallelLinear, RowParallelLinear
from batchrun.layers.norm import norm_heads_in_place
from batchrun.layers.rotary import RotaryEmbedding
from batchrun.models.blocks.context import BuildContext
from batchrun.parallel.partition import Run, ShardSpec


class Attention(nn.Module):
    def __init__(
        self,
        ctx: BuildContext,
        layer_id: int,
        *,
        window: int = 0,
        scaling: float | None = None,
        qk_norm: bool = False,
        sinks: bool = False,
    ):
        """window: attention over the last `window` positions (0: the whole context); scaling:
        the softmax scale (None: head_dim ** -0.5); qk_norm: an RMSNorm over each q and k head
        before rotary; sinks: a learned logit per head in each softmax's denominator."""
        super().__init__()
        cfg, part = ctx.cfg, ctx.part
        self.layer_id = layer_id
        # the pool's buffer pair this layer attends over (its source layer's, for a layer that
        # reads another layer's KV)
        self.kv_layer = cfg.kv_layers.index(cfg.kv_source(layer_id))
        self.window = window
        # this rank's heads (all of them at TP=1)
        self.num_heads, self.num_kv_heads = part.num_heads, part.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = part.q_size, part.kv_size
        self.scaling = cfg.head_dim**-0.5 if scaling is None else scaling
        qkv_rows = part.q_size + 2 * part.kv_size
        prefix = f"model.layers.{layer_id}.self_attn"
        qkv = tuple(f"{prefix}.{n}_proj" for n in "qkv")
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size,
            part.qkv_spec(cfg),
            qkv_rows,
            bias=cfg.qkv_bias,
            dtype=ctx.dtype,
            device=ctx.device,
            kernels=ctx.kernels,
            quant=ctx.quant_plan(qkv, qkv_rows, cfg.hidden_size),
        )
        o_quant = ctx.quant_plan((f"{prefix}.o_proj",), cfg.hidden_size, part.q_size)
        self.o_proj = RowParallelLinear(
            part.o_spec(cfg), cfg.hidden_size, cfg.o_bias, ctx.tp, ctx.dtype, ctx.device,
            ctx.kernels, o_quant,
        )  # fmt: skip
        # the FP8 KV cache's scales when the checkpoint has them (k_scale / v_scale), kept for
        # a KV cache that reads them; None: none in the checkpoint
        self.k_scale: float | None = None
        self.v_scale: float | None = None
        # NOTE: q/k norms are per head (weight [head_dim]): replicated, whatever the split
        self.q_norm = ctx.norm(cfg.head_dim) if qk_norm else None
        self.k_norm = ctx.norm(cfg.head_dim) if qk_norm else None
        # a sink logit per head (this rank's heads), fp32 as the softmax reads it
        self.sinks = None
        self._sink_spec = None
        if sinks:
            self.sinks = nn.Parameter(
                torch.empty(part.num_heads, dtype=torch.float32, device=ctx.device)
            )
            self._sink_spec = ShardSpec(
                0, cfg.num_heads, (Run(part.head_start, 0, part.num_heads),)
            )

    def param_shards(self) -> dict[str, ShardSpec]:
        return {} if self._sink_spec is None else {"sinks": self._sink_spec}

    def project(self, x: torch.Tensor):
        """(q, k, v) of the normed hidden states x [T, hidden]."""
        return self.split_heads(self.qkv_proj(x))

    def split_heads(self, qkv: torch.Tensor):
        """q [T, H, D], k and v [T, KV, D] from the qkv projection, q/k norm applied (before
        rotary)."""
        # NOTE: q, k, v are strided views of qkv; rotary may rotate q and k in place, which is safe
        # because nothing reads qkv afterwards (the q/k norms' kernel writes in place too)
        normed = self.q_norm is None or norm_heads_in_place(
            qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads,
                                                      self.head_dim),
            self.q_norm, self.k_norm, self.num_heads,
        )  # fmt: skip
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, KV, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if not normed:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rotary and attention by the backend, which may rotate inside its KV store (one kernel
        instead of two); into `out` [T, H, D] where given."""
        return backend.forward_rotary(
            q, k, v, self.kv_layer, self.scaling, positions, rotary, out=out,
            window=self.window, sinks=self.sinks,
        )  # fmt: skip
