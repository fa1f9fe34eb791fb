"""Qwen3.5 / Qwen3.6, dense and MoE: Qwen3-Next's hybrid decoder (models/qwen3_next.py) with the
linear layers' input projections stored apart (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a).

    Qwen3_5ForConditionalGeneration     model_type qwen3_5, the numbers in text_config (as
    Qwen3_5MoeForConditionalGeneration  shipped: qwen3_5_moe); the vision tower (model.visual)
                                        and the MTP head (mtp.*) are not run
    Qwen3_5ForCausalLM                  model_type qwen3_5_text, the text model as transformers
    Qwen3_5MoeForCausalLM               saves it (qwen3_5_moe_text)

The MoE models have experts on every layer, the top-k weights always renormalized, and a
sigmoid-gated shared expert; their configs name no intermediate_size (no dense MLP).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from batchrun.errors import ModelConfigError
from batchrun.models import qwen3_next
from batchrun.models.moe_config import experts_by_step
from batchrun.models.spec import HYBRID_QUANT_FORMATS, ArchSpec, TensorNames

DENSE, MOE = "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"
# the top-level fields of a ...ForConditionalGeneration config that apply to its text model
TOP_LEVEL = ("architectures", "eos_token_id", "bos_token_id", "torch_dtype", "dtype",
             "tie_word_embeddings", "quantization_config")  # fmt: skip
# a MoE text config's fields that Qwen3-Next reads and Qwen3.5-MoE fixes
MOE_FIXED = ("decoder_sparse_step", "mlp_only_layers")


def prepare(
    raw: dict[str, Any], source: str, multimodal: bool, moe: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    where = source
    if multimodal:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ModelConfigError(
                f"{source}: {raw.get('architectures')} needs text_config (the text model's "
                f"config), got {text!r}"
            )
        where = f"{source} text_config"
        text = {**text, **{k: raw[k] for k in TOP_LEVEL if raw.get(k) is not None}}
    else:
        text = dict(raw)
    if moe:
        for key in MOE_FIXED:
            if text.get(key) not in (None, 1, []):
                raise ModelConfigError(
                    f"{where}: {key} {text[key]!r} is not supported for Qwen3.5-MoE (experts "
                    "on every layer)"
                )
        text["norm_topk_prob"] = True
        text.setdefault("intermediate_size", text.get("shared_expert_intermediate_size"))
    return qwen3_next.prepare_hybrid(text, where, fused=False)


def experts(raw: dict[str, Any], num_layers: int, source: str, arch: str):
    return experts_by_step(raw, arch, num_layers, source, shared_expert=True)


def no_experts(raw: dict[str, Any], num_layers: int, source: str):
    return None


# the multimodal checkpoint's text model (transformers 5's names and the shipped ones)
MULTIMODAL_NAMES = TensorNames(
    renames=(("model.language_model.", "model."),),
    skipped=("model.visual.", "visual.", "mtp."),
    layer_renames=qwen3_next.LINEAR_LAYER_NAMES,
)
TEXT_NAMES = TensorNames(skipped=("mtp.",), layer_renames=qwen3_next.LINEAR_LAYER_NAMES)


def _spec(name: str, model_type: str, multimodal: bool, moe: bool) -> ArchSpec:
    return ArchSpec(
        name=name, model_type=model_type, family="Qwen3.5/3.6" + ("-MoE" if moe else ""),
        build=qwen3_next.build, qk_norm=True, o_proj_bias=True, partial_rotary=True,
        prepare=partial(prepare, multimodal=multimodal, moe=moe),
        moe=partial(experts, arch=MOE) if moe else no_experts,
        names=MULTIMODAL_NAMES if multimodal else TEXT_NAMES,
        layer_linears=qwen3_next.hybrid_linears, quant_formats=HYBRID_QUANT_FORMATS,
    )  # fmt: skip


SPEC = _spec(DENSE, "qwen3_5_text", multimodal=False, moe=False)
MOE_SPEC = _spec(MOE, "qwen3_5_moe_text", multimodal=False, moe=True)
MULTIMODAL_SPEC = _spec("Qwen3_5ForConditionalGeneration", "qwen3_5", multimodal=True, moe=False)
MULTIMODAL_MOE_SPEC = _spec(
    "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", multimodal=True, moe=True
)
