"""Qwen3-Next (Qwen3NextForCausalLM): the hybrid decoder that Qwen3.5 / Qwen3.6
(models/qwen3_5.py) share. Three of every four layers are Gated DeltaNet linear attention
(models/blocks/gated_deltanet.py: a recurrent state a request, engine/state_pool.py), the fourth
is attention with an output gate (models/blocks/gated_attention.py) and q/k norms, rotating a
quarter of each head (partial_rotary_factor); every RMSNorm but the linear layers' gated one is
zero-centred (weight stored as its offset from 1); the MLP is an MoE with a sigmoid-gated shared
expert (or a dense gated MLP).

What batchrun reads beyond the common fields: layer_types / full_attention_interval and the
linear_* numbers (models/hybrid_config.py); num_experts, num_experts_per_tok,
moe_intermediate_size, shared_expert_intermediate_size, norm_topk_prob, decoder_sparse_step,
mlp_only_layers (models/moe_config.py); the rope parameters' mrope_section and
mrope_interleaved (Qwen3.5's multimodal rotary) are accepted: for text every position row is the
same, which is plain partial rotary. Its checkpoint fuses the linear layers' input projections
(in_proj_qkvz, in_proj_ba); its MTP head (mtp.*) is not run. Tensor parallelism splits the
linear layers by key head (models/blocks/gated_deltanet.py). A quantized checkpoint (in one of
HYBRID_QUANT_FORMATS; the others are refused) has its linears load in its format but for those
its config leaves out (its `ignore` list: typically the small
in_proj_ba / in_proj_b / in_proj_a, the router and the shared expert's gate), which load plain;
the conv, dt_bias and A_log are plain in every format (`hybrid_linears` lists what may be
quantized). Refused: a field of REFUSED.
"""

from __future__ import annotations

from typing import Any

from batchrun.engine.state_pool import StatePool
from batchrun.errors import ModelConfigError
from batchrun.models import hybrid_config
from batchrun.models.blocks.context import BuildContext
from batchrun.models.blocks.gated_attention import GatedAttention
from batchrun.models.blocks.gated_deltanet import GatedDeltaNet
from batchrun.models.blocks.layer import PreNormLayer
from batchrun.models.blocks.mlp import experts_or_dense
from batchrun.models.blocks.model import CausalLM
from batchrun.models.config import ModelConfig
from batchrun.models.moe_config import experts_by_step
from batchrun.models.quant_loader import Linears, attention_linears, mlp_linears
from batchrun.models.spec import HYBRID_QUANT_FORMATS, ArchSpec, TensorNames

NAME = "Qwen3NextForCausalLM"
# the multimodal rotary's fields: for text positions they change nothing
MROPE_FIELDS = ("mrope_section", "mrope_interleaved")
# fields that change the math and that the blocks do not implement
REFUSED = ("use_sliding_window", "attn_logit_softcapping", "final_logit_softcapping")


def prepare_hybrid(
    raw: dict[str, Any], where: str, fused: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(raw with the M-RoPE fields dropped, the hybrid ModelConfig fields)."""
    for key in REFUSED:
        if raw.get(key):
            raise ModelConfigError(
                f"{where}: {key} {raw[key]!r} is not supported for the Qwen3-Next / Qwen3.5 "
                f"hybrids (their configs have it unset)"
            )
    raw = dict(raw)
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(raw.get(key), dict):
            raw[key] = {k: v for k, v in raw[key].items() if k not in MROPE_FIELDS}
    lin = hybrid_config.read(raw, where, fused_projections=fused)
    return raw, dict(linear_attention=lin, attn_output_gate=True, norm_plus_one=True)


def prepare(raw: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return prepare_hybrid(raw, source, fused=True)


def experts(raw: dict[str, Any], num_layers: int, source: str):
    return experts_by_step(raw, NAME, num_layers, source, shared_expert=True)


def build(cfg: ModelConfig, ctx: BuildContext) -> CausalLM:
    """Linear-attention and gated-attention layers; the model's `state_pool` holds the linear
    layers' states (allocated by the model runner)."""
    lin = cfg.linear_attention
    assert lin is not None
    states = StatePool(lin, ctx.tp.size)
    layers = [
        PreNormLayer(
            ctx,
            GatedDeltaNet(ctx, i, states) if lin.is_linear(i) else GatedAttention(ctx, i),
            experts_or_dense(ctx, i),
        )
        for i in range(cfg.num_layers)
    ]
    model = CausalLM(ctx, layers)
    model.state_pool = states
    return model


def hybrid_linears(cfg: ModelConfig, layer_id: int) -> Linears:
    """A layer's quantizable linears (models/quant_loader.py's form): a linear layer's input
    projections and out_proj (in our self_attn seat), or the gated attention's; the MLP's."""
    lin = cfg.linear_attention
    assert lin is not None
    if not lin.is_linear(layer_id):
        return attention_linears(cfg) + mlp_linears(cfg, layer_id)
    key = lin.num_k_heads * lin.head_k_dim
    value = lin.num_v_heads * lin.head_v_dim
    hv = lin.num_v_heads
    if lin.fused_projections:
        rows = {"in_proj_qkvz": 2 * key + 2 * value, "in_proj_ba": 2 * hv}
    else:
        rows = {"in_proj_qkv": lin.conv_dim, "in_proj_z": value, "in_proj_b": hv, "in_proj_a": hv}
    linears = [
        (f"self_attn.{name}", ((f"linear_attn.{name}", n),), cfg.hidden_size)
        for name, n in rows.items()
    ]
    linears.append(("self_attn.o_proj", (("linear_attn.out_proj", cfg.hidden_size),), value))
    return linears + mlp_linears(cfg, layer_id)


# the linear layers' modules sit in the layer's attention seat (self_attn); the gated RMSNorm's
# weight is plain, so its name leaves the loader's zero-centred "norm.weight" rule
LINEAR_LAYER_NAMES = (
    ("linear_attn.norm.", "self_attn.gated_rms."),
    ("linear_attn.out_proj.", "self_attn.o_proj."),
    ("linear_attn.", "self_attn."),
)
NAMES = TensorNames(skipped=("mtp.",), layer_renames=LINEAR_LAYER_NAMES)
SPEC = ArchSpec(name=NAME, model_type="qwen3_next", family="Qwen3-Next", build=build,
                qk_norm=True, o_proj_bias=True, partial_rotary=True, prepare=prepare,
                moe=experts, names=NAMES, layer_linears=hybrid_linears,
                quant_formats=HYBRID_QUANT_FORMATS)  # fmt: skip
