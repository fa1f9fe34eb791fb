"""A model's parameter counts from its config alone (no weights read): the total, and the active
ones a token runs through (a mixture of experts runs top-k of its experts), for `plan`, the
start-up log and the size rules of batchrun/config.py."""

from __future__ import annotations

from typing import NamedTuple

from batchrun.models.config import ModelConfig
from batchrun.models.hybrid_config import LinearAttentionConfig


class ParamCounts(NamedTuple):
    total: int
    active: int  # what one token reads: the top-k experts of each MoE layer, not all of them
    decoder_total: int  # the decoder layers alone (no embeddings, lm_head, final norm)
    decoder_active: int

    def describe(self) -> str:
        if self.total == self.active:
            return f"{_billions(self.total)} parameters"
        return f"{_billions(self.total)} parameters, {_billions(self.active)} active a token"


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _mlp(hidden: int, width: int, bias: bool) -> int:
    """A gated MLP (SwiGLU, GeGLU): gate, up ([width, hidden] each) and down ([hidden, width])."""
    return 3 * hidden * width + (2 * width + hidden if bias else 0)


def _linear_attention(hidden: int, lin: LinearAttentionConfig) -> int:
    """A Gated DeltaNet layer: the q, k, v, z, b, a projections, the conv, dt_bias, A_log, the
    gated norm and out_proj."""
    value = lin.num_v_heads * lin.head_v_dim
    projections = hidden * (lin.conv_dim + value + 2 * lin.num_v_heads) + value * hidden
    return projections + lin.conv_dim * lin.conv_kernel + 2 * lin.num_v_heads + lin.head_v_dim


def count_params(cfg: ModelConfig) -> ParamCounts:
    h = cfg.hidden_size
    q, kv = cfg.q_size, cfg.kv_size
    attention = h * (q + 2 * kv) + q * h
    if cfg.qkv_bias:
        attention += q + 2 * kv
    if cfg.o_bias:
        attention += h
    if cfg.qk_norm:
        attention += 2 * cfg.head_dim
    if cfg.attention_sinks:
        attention += cfg.num_heads
    if cfg.attn_output_gate:  # q_proj's gate rows
        attention += q * h
    lin = cfg.linear_attention
    norms = (4 if cfg.sandwich_norms else 2) * h  # sandwich norms: four a layer
    dense_mlp = _mlp(h, cfg.intermediate_size, cfg.mlp_bias)
    total = active = 0
    moe = cfg.moe
    for i in range(cfg.num_layers):
        layer = attention + norms
        if lin is not None and lin.is_linear(i):
            layer = _linear_attention(h, lin) + norms
        if moe is None or not moe.is_moe_layer(i):
            total += layer + dense_mlp
            active += layer + dense_mlp
            continue
        router = moe.num_experts * (h + 1 if moe.router_bias else h)
        expert = _mlp(h, moe.intermediate_size, moe.expert_bias)
        shared = 0
        if moe.shared_expert_intermediate_size:
            shared = _mlp(h, moe.shared_expert_intermediate_size, False) + h  # + its gate
        total += layer + router + moe.num_experts * expert + shared
        active += layer + router + moe.top_k * expert + shared
    outer = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + h  # + the final norm
    return ParamCounts(total + outer, active + outer, total, active)


def describe_params(cfg: ModelConfig) -> str:
    """The counts in one line, a mixture's experts named: "30.53 B parameters, 3.35 B active a
    token (8 of 128 experts a token in 48 of 48 layers)"."""
    text = count_params(cfg).describe()
    moe = cfg.moe
    if moe is None:
        return text
    shared = ", and a shared expert" if moe.shared_expert_intermediate_size else ""
    return (
        f"{text} ({moe.top_k} of {moe.num_experts} experts a token in {len(moe.layers)} of "
        f"{cfg.num_layers} layers{shared})"
    )
