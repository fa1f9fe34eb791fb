"""Tiny Gemma 4 models for the CPU tests: transformers' Gemma4TextConfig at small sizes, random
weights spread so that every norm, scalar and scale matters, saved as real checkpoints.

Kinds:
    dense     sliding layers of head dim 16 and 2 KV heads, full layers of head dim 32 with one
              KV head and attention_k_eq_v (the shipped 31B's shape), softcapped logits
    moe       dense plus the MoE block (a dense MLP beside 4 experts, top 2)
    e-model   per-layer inputs, the last 3 layers KV-shared with a double-wide MLP
    mm        e-model as the text model of a Gemma4ForConditionalGeneration (transformers 5's
              `model.language_model.*` names), written in the shipped config form
              (global_head_dim, num_global_key_value_heads; no per_layer_config)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

WINDOW = 12  # the sliding layers' window: the tests' prompts run past it
KINDS = ("dense", "moe", "e-model", "mm")
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2 + [
    "sliding_attention",
    "full_attention",
]


def text_config(kind: str, **changes):
    from transformers import Gemma4TextConfig

    fields = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=WINDOW,
        layer_types=list(LAYER_TYPES),
        max_position_embeddings=512,
        hidden_size_per_layer_input=0,
        final_logit_softcapping=30.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1_000_000.0,
            },
        },
    )
    if kind == "moe":
        fields.update(
            enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32
        )
    if kind in ("e-model", "mm"):
        fields.update(
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=256,
            num_kv_shared_layers=3,
            use_double_wide_mlp=True,
            attention_k_eq_v=False,
        )
    return Gemma4TextConfig(**{**fields, **changes})


def spread_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter and buffer of the text model drawn at random: norms and scales around 1,
    weights around 0 with a spread that keeps the logits' top tokens apart."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        tensors = list(model.named_parameters()) + list(model.named_buffers())
        for name, t in tensors:
            if not t.is_floating_point() or "inv_freq" in name or name.endswith("embed_scale"):
                continue
            noise = torch.randn(t.shape, generator=gen)
            if name.endswith(("norm.weight", "scale", "layer_scalar")):
                t.copy_(1.0 + 0.3 * noise)
            else:
                t.copy_(0.08 * noise)


def make_gemma4(kind: str, path: Path, seed: int = 0, **changes):
    """Save a random Gemma 4 model of `kind` (its text config's fields changed by `changes`) to
    `path`; returns the transformers model (fp32)."""
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    torch.manual_seed(seed)
    text = text_config(kind, **changes)
    if kind == "mm":
        model = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text.to_dict()))
    else:
        model = Gemma4ForCausalLM(text)
    model = model.to(torch.float32).eval()
    spread_(model, seed)
    model.save_pretrained(path)
    if kind == "mm":  # the shipped form: global_head_dim and num_global_key_value_heads
        raw = json.loads((path / "config.json").read_text())
        raw["text_config"].pop("per_layer_config")
        raw["text_config"].update(global_head_dim=32, num_global_key_value_heads=1)
        (path / "config.json").write_text(json.dumps(raw))
    return model
