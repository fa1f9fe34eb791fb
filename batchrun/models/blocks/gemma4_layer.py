"""Gemma 4's decoder layer (transformers' Gemma4TextDecoderLayer) from the shared blocks:

    h = x + post_attention_layernorm(attention(input_layernorm(x)))
    m = mlp(pre_feedforward_layernorm(h))
    MoE layers:  m = post_feedforward_layernorm_1(m) + post_feedforward_layernorm_2(
                       experts(pre_feedforward_layernorm_2(h), router(h)))
    h = h + post_feedforward_layernorm(m)
    E-models:    h = h + post_per_layer_input_norm(per_layer_projection(
                           gelu_tanh(per_layer_input_gate(h)) * per_layer_input))
    out = h * layer_scalar

The attention: per-layer head dim and KV heads, q/k norms with weights, v normed without one,
scaling 1; `attention_k_eq_v` full layers read v from k_proj (the loader fills v's rows of the
fused qkv_proj with k_proj); a layer that reads another layer's KV (num_kv_shared_layers) has a
q projection only and writes no KV.

The layer returns its whole output (residual None): the layer scalar multiplies the sum, so no
residual add is left to the next layer's norm.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.layers.linear import ColumnParallelLinear
from batchrun.layers.moe import ExpertExtras, moe_experts
from batchrun.models.blocks.attention import Attention
from batchrun.models.blocks.context import BuildContext
from batchrun.models.blocks.mlp import GatedMLP
from batchrun.parallel.partition import Run, ShardSpec, partition_model


def layer_context(ctx: BuildContext, layer_id: int) -> BuildContext:
    """ctx with layer_id's head dim and KV heads as the config's (so the shared blocks and the
    tensor-parallel split read them)."""
    cfg = ctx.cfg
    head_dim, kv_heads = cfg.head_dim_of(layer_id), cfg.kv_heads_of(layer_id)
    if (head_dim, kv_heads) == (cfg.head_dim, cfg.num_kv_heads):
        return ctx
    lcfg = replace(cfg, head_dim=head_dim, num_kv_heads=kv_heads)
    return replace(ctx, cfg=lcfg, part=partition_model(lcfg, ctx.tp.rank, ctx.tp.size))


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, in fp32, cast back (transformers' with_scale=False)."""
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


class Gemma4Attention(Attention):
    def __init__(self, ctx: BuildContext, layer_id: int, window: int):
        super().__init__(ctx, layer_id, window=window, scaling=1.0, qk_norm=True)
        self.eps = ctx.cfg.rms_norm_eps
        self.writes_kv = ctx.cfg.kv_source(layer_id) == layer_id
        if not self.writes_kv:  # q only: the KV is another layer's
            part = ctx.part
            spec = ShardSpec(
                0, ctx.cfg.q_size, (Run(part.head_start * part.head_dim, 0, part.q_size),)
            )
            quant = ctx.quant_plan(
                (f"model.layers.{layer_id}.self_attn.q_proj",), part.q_size, ctx.cfg.hidden_size
            )
            self.qkv_proj = ColumnParallelLinear(
                ctx.cfg.hidden_size, spec, part.q_size, bias=False, dtype=ctx.dtype,
                device=ctx.device, kernels=ctx.kernels, quant=quant,
            )  # fmt: skip
            self.k_norm = None

    def project(self, x: torch.Tensor):
        if not self.writes_kv:
            q = self.q_norm(self.qkv_proj(x).view(-1, self.num_heads, self.head_dim))
            return q, None, None
        q, k, v = self.split_heads(self.qkv_proj(x))
        return q, k, rms(v, self.eps)

    def attend(self, q, k, v, positions, rotary, backend, out=None) -> torch.Tensor:
        if k is not None:
            return super().attend(q, k, v, positions, rotary, backend, out)
        # NOTE: rotary rotates a q and a k; a one-head scratch stands for the k it does not need
        q, _ = rotary(positions, q, torch.zeros_like(q[:, :1]))
        return backend.forward(q, None, None, self.kv_layer, self.scaling, out, self.window)


class Gemma4Router(nn.Module):
    """transformers' Gemma4TextRouter: norm (no weight), times `scale` and hidden ** -0.5, a
    linear to the experts' logits, softmax in fp32, top-k, renormalized, times the chosen
    experts' `per_expert_scale`. With the fused experts the rows are padded to their tile
    count first (layers/moe.py's MoE._router_input says why: graph and eager steps then route
    alike)."""

    def __init__(self, ctx: BuildContext):
        super().__init__()
        cfg, moe = ctx.cfg, ctx.cfg.moe
        self.eps, self.top_k, self.root = cfg.rms_norm_eps, moe.top_k, cfg.hidden_size**-0.5
        kw = dict(dtype=ctx.dtype, device=ctx.device)
        self.proj = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False, **kw)
        self.scale = nn.Parameter(torch.empty(cfg.hidden_size, **kw))
        self.per_expert_scale = nn.Parameter(torch.empty(moe.num_experts, **kw))
        self._rows_for = None
        if ctx.kernels.moe == "triton":  # Triton: imported on CUDA only
            from batchrun.kernels.fused_moe import tile_tokens

            self._rows_for = tile_tokens

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k])."""
        num_tokens = x.shape[0]
        if self._rows_for is not None and self._rows_for(num_tokens) != num_tokens:
            x = F.pad(x, (0, 0, 0, self._rows_for(num_tokens) - num_tokens))
        h = rms(x, self.eps) * self.scale * self.root
        probs = torch.softmax(self.proj(h)[:num_tokens], dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4Experts(nn.Module):
    """Stacked experts with a GELU-tanh gate: gate_up_proj [E, 2I, H] (gate rows, then up),
    down_proj [E, H, I], each split along I under tensor parallelism (its partial sums are the
    layer's to all-reduce). KernelPlan.moe "torch": one expert at a time over its tokens, in
    expert order, as transformers adds them; "triton": the fused experts with the GELU-tanh
    epilogue (kernels/fused_moe.py), their decode batches on the GEMVs and large batches on
    torch._grouped_mm by the same rules as layers/moe.py's MoE."""

    def __init__(self, ctx: BuildContext):
        super().__init__()
        cfg, part, kernels = ctx.cfg, ctx.part, ctx.kernels
        moe = cfg.moe
        self.backend, self.top_k, self.pdl = kernels.moe, moe.top_k, kernels.pdl
        self._takes_gemv = self._takes_grouped_mm = None
        if self.backend == "triton" and kernels.moe_decode == "gemv":
            from batchrun.kernels.moe_gemv import takes_gemv

            self._takes_gemv = takes_gemv
        if self.backend == "triton" and kernels.moe_prefill == "grouped_mm":
            from batchrun.kernels.moe_grouped_mm import takes_grouped_mm

            self._takes_grouped_mm = takes_grouped_mm
        self._specs = {
            "gate_up_proj": part.gate_up_spec(cfg, moe.intermediate_size, dim=1),
            "down_proj": part.down_spec(cfg, moe.intermediate_size, dim=2),
        }
        local, hidden, num = part.moe_intermediate_size, cfg.hidden_size, moe.num_experts
        kw = dict(dtype=ctx.dtype, device=ctx.device)
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * local, hidden, **kw))
        self.down_proj = nn.Parameter(torch.empty(num, hidden, local, **kw))

    def param_shards(self) -> dict[str, ShardSpec]:
        return dict(self._specs)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        num_tokens, hidden = x.shape  # x [T, H], weights [T, k] fp32, ids [T, k]
        num_experts, inter = self.gate_up_proj.shape[0], self.down_proj.shape[2]
        decode, prefill = "grouped", "triton"
        if self._takes_gemv is not None and self._takes_gemv(num_tokens, self.top_k, num_experts):
            decode = "gemv"
        if self._takes_grouped_mm is not None and self._takes_grouped_mm(
            num_tokens, num_experts, self.top_k, hidden, inter
        ):
            prefill = "grouped_mm"
        return moe_experts(
            x, self.gate_up_proj, self.down_proj, weights, ids, self.backend,
            ExpertExtras(act="gelu_pytorch_tanh"), decode, prefill, self.pdl,
        )  # fmt: skip


class Gemma4Layer(nn.Module):
    def __init__(self, ctx: BuildContext, layer_id: int, mlp_width: int, per_layer_dim: int):
        """mlp_width: the dense MLP's (twice intermediate_size in a double-wide KV-shared
        layer); per_layer_dim: hidden_size_per_layer_input (0: no per-layer input)."""
        super().__init__()
        cfg = ctx.cfg
        lctx = layer_context(ctx, layer_id)
        self.input_layernorm = ctx.norm()
        self.self_attn = Gemma4Attention(lctx, layer_id, cfg.window(layer_id))
        self.post_attention_layernorm = ctx.norm()
        self.pre_feedforward_layernorm = ctx.norm()
        self.mlp = GatedMLP(ctx, layer_id, act="gelu_pytorch_tanh", width=mlp_width)
        self.post_feedforward_layernorm = ctx.norm()
        self.layer_scalar = nn.Parameter(torch.empty(1, dtype=ctx.dtype, device=ctx.device))
        self.tp = ctx.tp
        self.router = self.experts = None
        if cfg.moe is not None:
            self.router, self.experts = Gemma4Router(ctx), Gemma4Experts(ctx)
            self.post_feedforward_layernorm_1 = ctx.norm()
            self.post_feedforward_layernorm_2 = ctx.norm()
            self.pre_feedforward_layernorm_2 = ctx.norm()
        self.per_layer_dim = per_layer_dim
        if per_layer_dim:
            kw = dict(bias=False, dtype=ctx.dtype, device=ctx.device)
            self.per_layer_input_gate = nn.Linear(cfg.hidden_size, per_layer_dim, **kw)
            self.per_layer_projection = nn.Linear(per_layer_dim, cfg.hidden_size, **kw)
            self.post_per_layer_input_norm = ctx.norm()

    def pre_attention(self, x: torch.Tensor, residual: torch.Tensor | None):
        """(q, k, v, x): k and v None in a layer that reads another layer's KV."""
        q, k, v = self.self_attn.project(self.input_layernorm(x))
        return q, k, v, x

    def post_attention(self, attn_out, residual, per_layer_input=None):
        """(the layer's output, None) from the attention's output and the layer's input."""
        h = residual + self.post_attention_layernorm(self.self_attn.o_proj(attn_out))
        m = self.mlp(self.pre_feedforward_layernorm(h))
        if self.experts is not None:
            weights, ids = self.router(h)
            e = self.experts(self.pre_feedforward_layernorm_2(h), weights, ids)
            if self.tp.is_parallel:
                e = self.tp.all_reduce(e)
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(e)
        h = h + self.post_feedforward_layernorm(m)
        if self.per_layer_dim:
            g = F.gelu(self.per_layer_input_gate(h), approximate="tanh") * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return h * self.layer_scalar, None
