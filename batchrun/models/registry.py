"""The architectures batchrun runs: config.json's `architectures` name -> its spec, one line each.
A spec lives in the architecture's own file (models/spec.py says what it holds); the model_type
of a config.json that lists no architectures maps through the specs' model_type."""

from __future__ import annotations

from typing import Any

from batchrun.errors import ModelConfigError
from batchrun.models import (
    bert,
    gemma3,
    gemma4,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    modernbert,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
    xlm_roberta,
)
from batchrun.models.config import what_it_has
from batchrun.models.encoder_spec import EncoderSpec
from batchrun.models.spec import ArchSpec

ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": llama.SPEC,
    "MistralForCausalLM": mistral.SPEC,
    "Qwen2ForCausalLM": qwen2.SPEC,
    "Qwen3ForCausalLM": qwen3.SPEC,
    "Qwen2MoeForCausalLM": qwen2_moe.SPEC,
    "Qwen3MoeForCausalLM": qwen3_moe.SPEC,
    "MixtralForCausalLM": mixtral.SPEC,
    "Phi3ForCausalLM": phi3.SPEC,
    "Gemma3ForCausalLM": gemma3.SPEC,
    "Gemma3ForConditionalGeneration": gemma3.MULTIMODAL_SPEC,
    "Gemma4ForCausalLM": gemma4.SPEC,
    "Gemma4ForConditionalGeneration": gemma4.MULTIMODAL_SPEC,
    "GptOssForCausalLM": gpt_oss.SPEC,
    "Qwen3NextForCausalLM": qwen3_next.SPEC,
    "Qwen3_5ForCausalLM": qwen3_5.SPEC,
    "Qwen3_5MoeForCausalLM": qwen3_5.MOE_SPEC,
    "Qwen3_5ForConditionalGeneration": qwen3_5.MULTIMODAL_SPEC,
    "Qwen3_5MoeForConditionalGeneration": qwen3_5.MULTIMODAL_MOE_SPEC,
}
# bidirectional encoders: embed / rerank / score / classify only (batchrun/pooling runs them)
ENCODERS: dict[str, EncoderSpec] = {
    "BertModel": bert.SPEC,
    "BertForSequenceClassification": bert.CLASSIFIER_SPEC,
    "XLMRobertaModel": xlm_roberta.SPEC,
    "XLMRobertaForSequenceClassification": xlm_roberta.CLASSIFIER_SPEC,
    "ModernBertModel": modernbert.SPEC,
    "ModernBertForSequenceClassification": modernbert.CLASSIFIER_SPEC,
}
# model_type -> the architecture batchrun runs for it when config.json lists no architectures
# (what transformers' AutoModelForCausalLM does)
MODEL_TYPES = {spec.model_type: name for name, spec in ARCHITECTURES.items()}


def spec_of(architecture: str) -> ArchSpec:
    return ARCHITECTURES[architecture]


def partial_rotary_names() -> tuple[str, ...]:
    """The architectures whose attention may rotate part of a head."""
    return tuple(name for name, spec in ARCHITECTURES.items() if spec.partial_rotary)


def spec_for(raw: dict[str, Any], source: str) -> ArchSpec:
    """The spec of config.json `raw`: its first supported `architectures` entry, or with none
    listed its model_type's."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None and not archs:
        arch = MODEL_TYPES.get(raw.get("model_type"))  # type: ignore[arg-type]
    if arch is None:
        families = dict.fromkeys(spec.family for spec in ARCHITECTURES.values())
        raise ModelConfigError(
            f"{source}: unsupported architecture: the file has {what_it_has(raw)}; batchrun "
            f"supports the architectures {', '.join(ARCHITECTURES)}, or with no "
            f"architectures the model_type {', '.join(MODEL_TYPES)} ({', '.join(families)})"
        )
    return ARCHITECTURES[arch]
