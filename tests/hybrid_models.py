"""Tiny random Qwen3-Next / Qwen3.5 / Qwen3.6 hybrids (Gated DeltaNet + gated attention) saved as
real checkpoints, for the parity tests against transformers (tests/e2e/test_parity_hybrid.py).

    qwen3_next          Qwen3NextConfig: MoE with a shared expert, one dense layer
                        (mlp_only_layers), fused in_proj_qkvz / in_proj_ba, MTP tensors added
    qwen3_5_text        Qwen3_5TextConfig (dense), the shipped M-RoPE fields
    qwen3_5_moe_text    Qwen3_5MoeTextConfig
    qwen3_5             Qwen3_5Config (multimodal names, a tiny vision tower), M-RoPE fields
    qwen3_5_moe         Qwen3_5MoeConfig (multimodal names), MTP tensors added by hand
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

KINDS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")
# layers: linear, full, linear, linear, full (a linear layer first and last but one)
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention",
               "full_attention"]  # fmt: skip
TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=len(LAYER_TYPES),
    layer_types=LAYER_TYPES,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    initializer_range=0.15,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
    tie_word_embeddings=False,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)  # fmt: skip
# the shipped rotary: a quarter of each head (4 of 16 dims: 2 frequencies) in three sections
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
         "mrope_section": [1, 1, 0], "mrope_interleaved": True}  # fmt: skip
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
              patch_size=4, temporal_patch_size=2, spatial_merge_size=2)  # fmt: skip
MTP_KINDS = ("qwen3_next", "qwen3_5_moe")


def make_config(kind: str, **changes):
    import transformers as tf

    if kind == "qwen3_next":
        return tf.Qwen3NextConfig(**{**TEXT, **MOE, "norm_topk_prob": True, "mlp_only_layers": [2],
                                     **changes})  # fmt: skip
    if kind == "qwen3_5_text":
        return tf.Qwen3_5TextConfig(**{**TEXT, "rope_parameters": MROPE, **changes})
    if kind == "qwen3_5_moe_text":
        return tf.Qwen3_5MoeTextConfig(**{**TEXT, **MOE, **changes})
    if kind == "qwen3_5":
        text = {**TEXT, "rope_parameters": MROPE, **changes}
        return tf.Qwen3_5Config(text_config=text, vision_config=VISION)
    if kind == "qwen3_5_moe":
        return tf.Qwen3_5MoeConfig(text_config={**TEXT, **MOE, **changes}, vision_config=VISION)
    raise ValueError(kind)


def _model_class(kind: str):
    import transformers as tf

    return {
        "qwen3_next": tf.Qwen3NextForCausalLM,
        "qwen3_5_text": tf.Qwen3_5ForCausalLM,
        "qwen3_5_moe_text": tf.Qwen3_5MoeForCausalLM,
        "qwen3_5": tf.Qwen3_5ForConditionalGeneration,
        "qwen3_5_moe": tf.Qwen3_5MoeForConditionalGeneration,
    }[kind]


def make_hybrid_model(kind: str, path: Path, seed: int = 0, **changes):
    """Save a random `kind` hybrid to `path`; returns the HF model (fp32, eval)."""
    torch.manual_seed(seed)
    model = _model_class(kind)._from_config(make_config(kind, **changes), dtype=torch.float32)
    model.eval()
    with torch.no_grad():  # zero-centred norms start at w = 0, the gated one at 1: spread them
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.normal_(1.0, 0.3)
            elif name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
            elif name.endswith("dt_bias"):
                param.normal_(0.0, 1.0)
    model.save_pretrained(path)
    if kind in MTP_KINDS:  # transformers writes no MTP head: add one as the shipped files have
        h = TEXT["hidden_size"]
        mtp = {
            "mtp.fc.weight": torch.randn(h, 2 * h),
            "mtp.norm.weight": torch.zeros(h),
            "mtp.layers.0.input_layernorm.weight": torch.zeros(h),
        }
        save_file(mtp, str(path / "model-mtp.safetensors"))
        index = path / "model.safetensors.index.json"
        if index.exists():
            data = json.loads(index.read_text())
            data["weight_map"].update({k: "model-mtp.safetensors" for k in mtp})
            index.write_text(json.dumps(data))
    return model
