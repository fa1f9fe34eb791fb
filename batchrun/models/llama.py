"""Llama (LlamaForCausalLM): Llama 2 / 3 / 3.x, SmolLM. The plain decoder that most other
architectures assemble too (`build`): pre-norm layers (models/blocks/layer.py), attention over
the whole context or, where the config gives one, a sliding window, q/k norms where the spec asks
for them, and a gated SiLU MLP, or the experts (layers/moe.py) on a mixture's MoE layers.

Llama's quirks: attention_bias also gives o_proj a bias; sliding_window is ignored (transformers
ignores it here)."""

from __future__ import annotations

from batchrun.models.blocks.attention import Attention
from batchrun.models.blocks.context import BuildContext
from batchrun.models.blocks.layer import PreNormLayer
from batchrun.models.blocks.mlp import experts_or_dense
from batchrun.models.blocks.model import CausalLM
from batchrun.models.config import ModelConfig
from batchrun.models.spec import ArchSpec


def decoder_layer(ctx: BuildContext, layer_id: int, sinks: bool = False) -> PreNormLayer:
    """Layer `layer_id`: its window, q/k norms where the config has them, `sinks` (a logit per
    head in the softmax's denominator), its MLP or experts."""
    cfg = ctx.cfg
    attn = Attention(ctx, layer_id, window=cfg.window(layer_id), qk_norm=cfg.qk_norm, sinks=sinks)
    return PreNormLayer(ctx, attn, experts_or_dense(ctx, layer_id))


def build(cfg: ModelConfig, ctx: BuildContext) -> CausalLM:
    return CausalLM(ctx, [decoder_layer(ctx, i) for i in range(cfg.num_layers)])


SPEC = ArchSpec(name="LlamaForCausalLM", model_type="llama", family="Llama 2/3/3.x, SmolLM",
                build=build, o_proj_bias=True)  # fmt: skip
