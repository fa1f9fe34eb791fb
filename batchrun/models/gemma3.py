"""Gemma 3 (Gemma3ForCausalLM, Gemma3ForConditionalGeneration's text model): a decoder of
sandwich-norm layers (four norms a layer: models/blocks/layer.py), a GELU-tanh gated MLP,
embeddings scaled by sqrt(hidden_size), q/k norms, attention scaled by query_pre_attn_scalar,
sliding layers with a rotary table of their own, every RMSNorm weight stored as its offset from 1.
Quantized checkpoints are refused.

`Gemma3ForCausalLM` (gemma-3-1b, model_type gemma3_text) has its numbers at the top level;
`Gemma3ForConditionalGeneration` (4b / 12b / 27b, model_type gemma3) has them in `text_config`,
with the token ids, dtype and quantization_config at the top level. Either text config leaves out
the fields whose value is transformers' Gemma3TextConfig default (the 4b's names no vocab_size
nor heads): TEXT_DEFAULTS fills them.

What batchrun reads, and what each does:

    hidden_activation           gelu_pytorch_tanh (the gated MLP's activation)
    query_pre_attn_scalar       attention scaling = query_pre_attn_scalar ** -0.5
    layer_types                 per layer "sliding_attention" or "full_attention"; without it
    (or sliding_window_pattern) every sliding_window_pattern-th layer is full (transformers' rule)
    sliding_window              the sliding layers' window
    rope_theta, rope_scaling    the full layers' rotary (linear factor 8 on 4b and larger)
    rope_local_base_freq        the sliding layers' rotary base (default rope)
    rope_parameters             transformers 5's form of the two: a dict per layer type

and refused when set: final_logit_softcapping, attn_logit_softcapping (Gemma 2's; null on every
Gemma 3), use_bidirectional_attention (an encoder's mask). The vision tower's config is not read:
batchrun runs the text model.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from batchrun.errors import ModelConfigError
from batchrun.models.blocks.attention import Attention
from batchrun.models.blocks.context import BuildContext
from batchrun.models.blocks.layer import SandwichNormLayer
from batchrun.models.blocks.mlp import GatedMLP
from batchrun.models.blocks.model import CausalLM, Rope
from batchrun.models.config import ModelConfig
from batchrun.models.spec import ArchSpec, TensorNames

MULTIMODAL = "Gemma3ForConditionalGeneration"
# transformers' Gemma3TextConfig defaults (configuration_gemma3.py)
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}
# the top-level fields of a Gemma3ForConditionalGeneration config that apply to its text model
TOP_LEVEL = (
    "architectures",
    "eos_token_id",
    "bos_token_id",
    "torch_dtype",
    "dtype",
    "tie_word_embeddings",
    "quantization_config",
)
LAYER_TYPES = ("sliding_attention", "full_attention")
REFUSED = ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention")


def prepare(
    raw: dict[str, Any], source: str, multimodal: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the text model's config.json fields, flattened: rope_theta / rope_scaling the full
    layers'; the ModelConfig fields Gemma 3 sets itself)."""
    if multimodal:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ModelConfigError(
                f"{source}: {MULTIMODAL} needs text_config (the text model's config), got {text!r}"
            )
        where = f"{source} text_config"
        text = {**TEXT_DEFAULTS, **text}
        text.update({k: raw[k] for k in TOP_LEVEL if raw.get(k) is not None})
    else:
        where, text = source, {**TEXT_DEFAULTS, **raw}
    for key in REFUSED:
        if text.get(key):
            raise ModelConfigError(
                f"{where}: {key} {text[key]!r} is not supported: batchrun runs Gemma 3, whose "
                f"configs have {key} null / false"
            )
    num_layers = int(text["num_hidden_layers"])
    layer_types = _layer_types(text, num_layers, where)
    window = text.get("sliding_window")
    if "sliding_attention" in layer_types and not (isinstance(window, int) and window >= 1):
        raise ModelConfigError(
            f"{where}: sliding_window must be >= 1 for its sliding layers (layer_types / "
            f"sliding_window_pattern); got {window!r}"
        )
    local, full = _rope(text, where)
    flat = {k: v for k, v in text.items() if k not in ("rope_parameters", "rope_scaling")}
    flat["rope_theta"] = full.pop("rope_theta")
    flat["rope_scaling"] = full
    return flat, dict(
        sliding_windows=tuple(window if t == "sliding_attention" else 0 for t in layer_types),
        local_rope_theta=float(local["rope_theta"]),
        query_pre_attn_scalar=float(text["query_pre_attn_scalar"]),
        embed_scale=True,
        norm_plus_one=True,
        sandwich_norms=True,
    )


def _layer_types(text: dict[str, Any], num_layers: int, where: str) -> list[str]:
    types = text.get("layer_types")
    if types is None:
        pattern = int(text["sliding_window_pattern"])
        if pattern < 1:
            raise ModelConfigError(f"{where}: sliding_window_pattern must be >= 1; got {pattern}")
        return [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad or len(types) != num_layers:
        raise ModelConfigError(
            f"{where}: layer_types must list {num_layers} layers (num_hidden_layers), each one "
            f"of {', '.join(LAYER_TYPES)}; got {len(types)} with {sorted(set(map(str, bad)))}"
        )
    return list(types)


def _rope(text: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the sliding layers' rope parameters, the full layers'), each with its rope_theta."""
    local: dict[str, Any] = {"rope_type": "default", "rope_theta": text["rope_local_base_freq"]}
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": text["rope_theta"]}
    if isinstance(text.get("rope_scaling"), dict):
        full.update(text["rope_scaling"])
    params = text.get("rope_parameters")
    if isinstance(params, dict):
        if set(params) <= set(LAYER_TYPES):  # transformers 5: a dict per layer type
            local.update(params.get("sliding_attention") or {})
            full.update(params.get("full_attention") or {})
        else:
            full.update(params)
    for rope in (local, full):
        if "type" in rope:
            rope.setdefault("rope_type", rope.pop("type"))
    if local["rope_type"] != "default":
        raise ModelConfigError(
            f"{where}: the sliding layers' rope type {local['rope_type']!r} is not supported "
            "(rope_parameters.sliding_attention); supported: default"
        )
    return local, full


def build(cfg: ModelConfig, ctx: BuildContext) -> CausalLM:
    """Sandwich-norm layers of a GELU-tanh MLP; the sliding layers rotate with their own base
    (default rope), the full ones with rope_theta and rope_scaling."""
    scaling = cfg.query_pre_attn_scalar**-0.5
    layers = [
        SandwichNormLayer(
            ctx,
            Attention(ctx, i, window=cfg.window(i), scaling=scaling, qk_norm=True),
            GatedMLP(ctx, i, act="gelu_pytorch_tanh"),
        )
        for i in range(cfg.num_layers)
    ]
    ropes = (
        Rope(cfg.rope_theta, cfg.rope_scaling),
        Rope(cfg.local_rope_theta, {"rope_type": "default"}),
    )
    layer_ropes = tuple(1 if cfg.window(i) else 0 for i in range(cfg.num_layers))
    return CausalLM(ctx, layers, embed_scale=True, ropes=ropes, layer_ropes=layer_ropes)


# the multimodal checkpoint's text model under its names as transformers 5 saves them and as the
# hub's checkpoints (transformers 4) have them; its vision tower and projector are not run
TEXT_MODEL = TensorNames(
    renames=(
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    ),
    skipped=(
        "model.vision_tower.",
        "vision_tower.",
        "model.multi_modal_projector.",
        "multi_modal_projector.",
    ),
)
SPEC = ArchSpec(name="Gemma3ForCausalLM", model_type="gemma3_text", family="Gemma 3",
                build=build, qk_norm=True, act_field="hidden_activation",
                activations=("gelu_pytorch_tanh",), prepare=prepare,
                quantizable=False)  # fmt: skip
MULTIMODAL_SPEC = ArchSpec(name=MULTIMODAL, model_type="gemma3", family="Gemma 3", build=build,
                           qk_norm=True, act_field="hidden_activation",
                           activations=("gelu_pytorch_tanh",),
                           prepare=partial(prepare, multimodal=True), quantizable=False,
                           names=TEXT_MODEL)  # fmt: skip
