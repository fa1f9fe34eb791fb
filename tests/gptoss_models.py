"""Tiny gpt-oss models for parity tests (no downloads), and MXFP4 checkpoints of them."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# every gpt-oss feature at a size the CPU runs in seconds: alternating sliding (window 8) and
# full layers, 8 experts top-4 of width 32, YaRN over an original context of 64, a SwiGLU limit
# that the activations reach (the released 7.0 rarely clamps at this size)
GPT_OSS_WINDOW = 8
GPT_OSS = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    initializer_range=0.15,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
    tie_word_embeddings=False,
    num_local_experts=8,
    num_experts_per_tok=4,
    sliding_window=GPT_OSS_WINDOW,
    swiglu_limit=1.5,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
    },
)


def gpt_oss_config(**changes):
    import transformers

    return transformers.GptOssConfig(**{**GPT_OSS, **changes})


def spread_gpt_oss_(model) -> None:
    """transformers initializes the expert biases to zero and the sinks small: draw them so that
    the tests see them. Its experts then clamp at the config's swiglu_limit: transformers 5.17
    (the H200 machine's) fixes alpha 1.702 and limit 7.0 whatever the config says, where later
    versions read swiglu_alpha / swiglu_limit, as batchrun does (the tiny model's 1.5 against
    a fixed 7.0 puts the logits 0.52-0.56 apart, relative)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("_proj_bias", "sinks")):
                param.normal_(0.0, 0.5)
    cfg = model.config
    for layer in model.model.layers:
        layer.mlp.experts.alpha = getattr(cfg, "swiglu_alpha", 1.702)
        layer.mlp.experts.limit = cfg.swiglu_limit


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 (blocks [..., G, 16] uint8, scales [..., G] uint8) of w [..., G * 32]: each block's
    scale the power of two that puts its largest magnitude at or below 6, each value the
    nearest FP4 (e2m1) one."""
    from batchrun.models.gptoss_weights import FP4_VALUES

    lut = torch.tensor(FP4_VALUES[:8])
    g = w.float().unflatten(-1, (-1, 32))  # [..., G, 32]
    amax = g.abs().amax(-1).clamp(min=1e-30)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = g / torch.exp2(exponent)[..., None]
    code = (scaled.abs()[..., None] - lut).abs().argmin(-1)  # [..., G, 32]
    code = code + 8 * (scaled < 0)
    nibbles = code.to(torch.uint8).unflatten(-1, (16, 2))
    blocks = nibbles[..., 0] | (nibbles[..., 1] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def save_mxfp4(hf, path: Path) -> None:
    """Save `hf` with its experts in MXFP4 as the released checkpoints ship them, after setting
    its expert weights to what that MXFP4 dequantizes to (so that `hf` is the reference)."""
    from safetensors.torch import save_file

    from batchrun.models.gptoss_weights import mxfp4_dequantize

    hf.save_pretrained(path)
    tensors = {}
    for name, param in hf.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = param.transpose(1, 2)  # [E, out, in]: the checkpoint's layout
            blocks, scales = quantize_mxfp4(rows)
            with torch.no_grad():
                param.copy_(mxfp4_dequantize(blocks, scales).transpose(1, 2))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        else:
            tensors[name] = param.detach().clone().contiguous()
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head",
        ],
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(raw))


# config.json of openai/gpt-oss-20b as its Hugging Face repository ships it (gpt-oss-120b: 36
# layers, 128 experts)
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}
GPT_OSS_120B = {
    **GPT_OSS_20B,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "num_hidden_layers": 36,
    "num_local_experts": 128,
}
