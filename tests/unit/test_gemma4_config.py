"""Gemma 4's config.json reading (models/gemma4.py): both forms of the per-layer head dims and KV
heads, the KV sources of shared layers, the ropes, the MoE block, and what is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gemma4_models import LAYER_TYPES, text_config  # noqa: E402

from batchrun.errors import ModelConfigError  # noqa: E402
from batchrun.layers.rotary import rope_inv_freq  # noqa: E402
from batchrun.models.config import ModelConfig  # noqa: E402
from batchrun.models.context import kv_bytes_per_token  # noqa: E402


def written(kind: str = "dense", **changes) -> dict:
    """config.json as transformers writes a Gemma4ForCausalLM's (per_layer_config)."""
    raw = text_config(kind).to_dict()
    raw["architectures"] = ["Gemma4ForCausalLM"]
    raw.update(changes)
    return raw


def shipped(kind: str = "dense", **changes) -> dict:
    """The Gemma4ForConditionalGeneration form the hub ships: global_head_dim."""
    text = written(kind)
    text.pop("per_layer_config")
    text.pop("architectures")
    text.update(global_head_dim=32, num_global_key_value_heads=1, **changes)
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
            "text_config": text, "vision_config": {"hidden_size": 8}}  # fmt: skip


def test_both_forms_give_the_same_layers():
    a = ModelConfig.from_dict(written())
    b = ModelConfig.from_dict(shipped())
    full = [i for i, t in enumerate(LAYER_TYPES) if t == "full_attention"]
    for cfg in (a, b):
        assert [cfg.head_dim_of(i) for i in full] == [32] * len(full)
        assert [cfg.kv_heads_of(i) for i in full] == [1] * len(full)
        assert cfg.head_dim_of(0) == 16 and cfg.kv_heads_of(0) == 2
        assert cfg.window(0) == 12 and cfg.window(full[0]) == 0
    assert (a.layer_head_dims, a.layer_kv_heads) == (b.layer_head_dims, b.layer_kv_heads)


def test_zero_padded_layer_keys():
    raw = written()
    raw["per_layer_config"] = {f"{int(k):02d}": v for k, v in raw["per_layer_config"].items()}
    assert all(len(k) == 2 for k in raw["per_layer_config"])
    cfg = ModelConfig.from_dict(raw)
    assert cfg.layer_head_dims == ModelConfig.from_dict(written()).layer_head_dims


def test_kv_shared_layers_read_the_last_earlier_layer_of_their_type():
    cfg = ModelConfig.from_dict(written("e-model"))
    # layers 5, 6, 7 (full, sliding, full) share: the last owners are 4 (sliding), 2 (full)
    assert cfg.kv_sources == (0, 1, 2, 3, 4, 2, 4, 2)
    assert cfg.kv_layers == (0, 1, 2, 3, 4)
    opts = cfg.arch_options
    assert opts.mlp_widths == (96,) * 5 + (192,) * 3  # double-wide where KV is shared
    assert opts.per_layer_dim == 8
    # KV bytes: the owners alone (4 sliding of 2 heads x 16, 1 full of 2 heads x 32: without
    # attention_k_eq_v the full layers keep num_key_value_heads), K and V, 16-bit
    assert kv_bytes_per_token(cfg) == 2 * (4 * 2 * 16 + 1 * 2 * 32) * 2


def test_moe_block_and_rope():
    cfg = ModelConfig.from_dict(written("moe"))
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (4, 2, 32)
    sliding, full = cfg.arch_options.ropes
    assert (sliding.dim, full.dim) == (16, 32)
    inv = rope_inv_freq(full.dim, full.theta, full.scaling)
    assert inv.shape == (16,) and (inv[4:] == 0).all() and (inv[:4] > 0).all()


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(num_kv_shared_layers=7), "no earlier layer of its type"),
        (
            dict(rope_parameters={"sliding_attention": {"rope_type": "yarn", "rope_theta": 1.0}}),
            "rope_type 'yarn' is not supported",
        ),
        (dict(enable_moe_block=True, num_experts=None), "enable_moe_block needs num_experts"),
        (dict(quantization_config={"quant_method": "fp8"}), "Gemma 4 checkpoint in fp8"),
    ],
)
def test_refused_by_name(change, match):
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_dict(written(**change))
