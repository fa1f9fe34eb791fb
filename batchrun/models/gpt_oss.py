"""gpt-oss (`GptOssForCausalLM`): Llama's blocks (models/llama.py) with attention sinks and
experts on every layer; what its config.json adds, read as transformers 5's GptOssConfig reads it.

    layer_types / sliding_window      sliding layers (window sliding_window) and full ones;
                                      without layer_types the even layers slide
    attention_bias                    q, k, v and o_proj biases
    (always)                          a learned sink logit per head in the softmax's
                                      denominator (self_attn.sinks)
    num_local_experts, num_experts_per_tok, intermediate_size
                                      every layer's experts, top-k, each expert's width; the
                                      router has a bias and takes the softmax of the top-k
                                      logits; the experts have biases
    swiglu_limit, swiglu_alpha        the experts' clamped SwiGLU: gate clamped above, up on
                                      both sides, (up + 1) * gate * sigmoid(alpha * gate)
    quantization_config mxfp4         the experts' weights in MXFP4 (*_blocks / *_scales),
                                      dequantized at load (models/gptoss_weights.py); the
                                      other weights are plain
    (checkpoint)                      mlp.router -> our mlp.gate; the experts stacked
                                      (models/gptoss_weights.py reads them)
    rope_parameters yarn              models/rope_config.py

Fields not read change nothing at inference: router_aux_loss_coef, output_router_logits,
initial_context_length and experts_per_token (the original release's names of
original_max_position_embeddings and num_experts_per_tok, which the file also has)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from batchrun.errors import ModelConfigError
from batchrun.models import llama
from batchrun.models.blocks.context import BuildContext
from batchrun.models.blocks.model import CausalLM
from batchrun.models.config import ModelConfig
from batchrun.models.gptoss_weights import GptOssExperts
from batchrun.models.moe_config import experts_every_layer
from batchrun.models.spec import ArchSpec, TensorNames

GPT_OSS = "GptOssForCausalLM"
LAYER_TYPES = ("sliding_attention", "full_attention")
# GptOssConfig's defaults
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0
SLIDING_WINDOW = 128
# quantization_config.modules_to_not_convert of the released checkpoints: everything but the
# experts is plain
MXFP4_PLAIN = ("self_attn", "mlp.router", "embed_tokens", "lm_head")


def prepare(raw: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json without its quantization_config, which covers the experts alone; the
    ModelConfig fields gpt-oss sets itself: its windows, sinks and experts)."""
    num_layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types is None:
        types = [LAYER_TYPES[i % 2] for i in range(num_layers)]
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad or len(types) != num_layers:
        raise ModelConfigError(
            f"{source}: layer_types must list {num_layers} layers (num_hidden_layers), each one "
            f"of {', '.join(LAYER_TYPES)}; got {len(types)} with {sorted(set(map(str, bad)))}"
        )
    window = raw.get("sliding_window", SLIDING_WINDOW)
    if "sliding_attention" in types and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ModelConfigError(
            f"{source}: sliding_window {window!r} is not a positive whole number of tokens, "
            "which the sliding layers of layer_types need"
        )
    alpha = _number(raw, "swiglu_alpha", SWIGLU_ALPHA, source)
    limit = _number(raw, "swiglu_limit", SWIGLU_LIMIT, source)
    if limit <= 0:
        raise ModelConfigError(f"{source}: swiglu_limit {limit} must be positive")
    mxfp4, rest = _quantization(raw, source)
    experts = experts_every_layer(
        rest,
        GPT_OSS,
        num_layers,
        source,
        expert_names=("gate_up_proj", "gate_up_proj", "down_proj"),
    )
    experts = replace(
        experts, router_bias=True, expert_bias=True, swiglu_alpha=alpha, swiglu_limit=limit,
        mxfp4=mxfp4,
    )  # fmt: skip
    return rest, dict(
        sliding_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
        attention_sinks=True,
        moe=experts,
    )


def _number(raw: dict[str, Any], key: str, default: float, source: str) -> float:
    value = raw.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelConfigError(f"{source}: {key} {value!r} is not a number")
    return float(value)


def _quantization(raw: dict[str, Any], source: str) -> tuple[bool, dict[str, Any]]:
    """(whether the experts are MXFP4, config.json without quantization_config). Only the
    released checkpoints' scheme runs: quant_method mxfp4 on the experts alone."""
    qcfg = raw.get("quantization_config")
    if qcfg is None:
        return False, raw
    method = qcfg.get("quant_method") if isinstance(qcfg, dict) else None
    if method != "mxfp4":
        raise ModelConfigError(
            f"{source}: quantization_config.quant_method {method!r} is not supported for "
            f"{GPT_OSS}; supported: mxfp4 (the experts' weights as released), or plain "
            "bf16 / fp16 / fp32 weights"
        )
    plain = qcfg.get("modules_to_not_convert") or []
    missing = [m for m in MXFP4_PLAIN if not any(m in p for p in plain)]
    if missing:
        raise ModelConfigError(
            f"{source}: quantization_config.modules_to_not_convert {plain!r} leaves "
            f"{', '.join(missing)} in MXFP4; batchrun reads MXFP4 for the experts only "
            f"(modules_to_not_convert naming {', '.join(MXFP4_PLAIN)})"
        )
    return True, {k: v for k, v in raw.items() if k != "quantization_config"}


def build(cfg: ModelConfig, ctx: BuildContext) -> CausalLM:
    layers = [llama.decoder_layer(ctx, i, sinks=True) for i in range(cfg.num_layers)]
    return CausalLM(ctx, layers)


SPEC = ArchSpec(name=GPT_OSS, model_type="gpt_oss", family="gpt-oss", build=build,
                qkv_bias=True, o_proj_bias=True, prepare=prepare,
                names=TensorNames(layer_renames=(("mlp.router.", "mlp.gate."),)),
                experts_reader=GptOssExperts)  # fmt: skip
