"""Phi-3 / Phi-4 configs (Phi3ForCausalLM): the real models' config.json resolve to the right
shapes, rotary and parameter counts (equal to transformers' models of them), LongRoPE's factors
and attention factor are transformers', and what does not run is refused naming the field."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from phi3_configs import PHI3_MEDIUM_128K_INSTRUCT, PHI4_MINI_INSTRUCT  # noqa: E402

from batchrun.errors import ModelConfigError  # noqa: E402
from batchrun.layers.rotary import RotaryEmbedding, rope_inv_freq  # noqa: E402
from batchrun.models.config import ModelConfig  # noqa: E402
from batchrun.models.param_count import count_params  # noqa: E402
from batchrun.parallel.partition import partition_model  # noqa: E402

# name -> (raw, heads, kv heads, rotary dim, tied, total parameters)
REAL = {
    "Phi-4-mini-instruct": (PHI4_MINI_INSTRUCT, 24, 8, 96, True, 3_836_021_760),
    "Phi-3-medium-128k-instruct": (PHI3_MEDIUM_128K_INSTRUCT, 40, 10, 128, False, 13_960_238_080),
}
CARDS = {"Phi-4-mini-instruct": 3.84, "Phi-3-medium-128k-instruct": 14.0}  # billions


@pytest.mark.parametrize("name", REAL)
def test_real_configs_resolve(name):
    raw, heads, kv_heads, rotary, tied, total = REAL[name]
    cfg = ModelConfig.from_dict(raw)
    assert cfg.architecture == "Phi3ForCausalLM"
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (heads, kv_heads, 128)
    assert cfg.rotary_dim == rotary and cfg.tie_word_embeddings == tied
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.qk_norm)
    assert cfg.sliding_windows == ()  # a window over max_position_embeddings leaves out nothing
    scaling = cfg.rope_scaling
    assert scaling["rope_type"] == "longrope"  # Phi-3-medium's "su" too
    assert scaling["original_max_position_embeddings"] == 4096
    assert len(scaling["short_factor"]) == len(scaling["long_factor"]) == rotary // 2
    assert scaling["attention_factor"] == pytest.approx(
        math.sqrt(1 + math.log(32) / math.log(4096))
    )
    counts = count_params(cfg)
    assert counts.total == counts.active == total
    assert total / 1e9 == pytest.approx(CARDS[name], rel=0.01)
    # a TP=2 split: heads and KV heads halve
    part = partition_model(cfg, 0, 2)
    assert (part.num_heads, part.num_kv_heads) == (heads // 2, kv_heads // 2)


@pytest.mark.parametrize("name", REAL)
def test_counts_and_rotary_equal_transformers(name):
    """transformers' model of the config (on the meta device) has count_params' parameters; its
    LongRoPE inverse frequencies (short, and long past the original length) and attention factor
    are batchrun's."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = REAL[name][0]
    # NOTE: transformers 5 reads "su" as "longrope" only after its key check, which then misses
    # original_max_position_embeddings: its config is given the new name
    hf_raw = {k: v for k, v in raw.items() if k != "auto_map"}
    hf_raw["rope_scaling"] = {**raw["rope_scaling"], "type": "longrope"}
    hf_cfg = transformers.Phi3Config(**hf_raw)
    with torch.device("meta"):
        hf = transformers.Phi3ForCausalLM(hf_cfg)
    cfg = ModelConfig.from_dict(raw)
    assert count_params(cfg).total == sum(p.numel() for p in hf.parameters())
    longrope = ROPE_INIT_FUNCTIONS["longrope"]
    short, factor = longrope(hf_cfg, "cpu")
    long, _ = longrope(hf_cfg, "cpu", seq_len=4097)
    theta, scaling = cfg.rope_theta, cfg.rope_scaling
    assert torch.equal(rope_inv_freq(cfg.rotary_dim, theta, scaling, 4096), short)
    assert torch.equal(rope_inv_freq(cfg.rotary_dim, theta, scaling, 4097), long)
    assert scaling["attention_factor"] == factor
    rotary = RotaryEmbedding.for_model(cfg, 8, "cpu")
    assert rotary.cos_cache.shape == (8, cfg.rotary_dim)
    assert rotary.cos_cache[0, 0].item() == pytest.approx(factor)  # cos 0 times the factor


def phi4(**changes) -> dict:
    return {**PHI4_MINI_INSTRUCT, **changes}


def phi4_rope(**changes) -> dict:
    return phi4(rope_scaling={**PHI4_MINI_INSTRUCT["rope_scaling"], **changes})


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (phi4_rope(type="ntk"), "rope type 'ntk' is not supported"),
        (phi4_rope(short_factor=[1.0] * 64), "short_factor has 64 numbers; .* 96 dims .* 48"),
        (phi4_rope(long_factor=None), "needs long_factor, a list of 48 numbers"),
        (phi4_rope(long_factor="1.0"), "needs long_factor"),
        (phi4(partial_rotary_factor=1.5), "partial_rotary_factor 1.5 gives 192 rotary dims"),
        (phi4(original_max_position_embeddings=0), "original_max_position_embeddings 0"),
    ],
)
def test_unsupported_fields_are_refused_by_name(raw, match):
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_a_window_under_the_context_applies_on_every_layer():
    """Phi-3-mini-4k's sliding_window 2047 (under max_position_embeddings): every layer."""
    cfg = ModelConfig.from_dict(phi4(sliding_window=2047))
    assert cfg.sliding_windows == (2047,) * cfg.num_layers


def test_partial_rotary_on_a_full_rotary_architecture_is_refused():
    raw = {**PHI3_MEDIUM_128K_INSTRUCT, "architectures": ["LlamaForCausalLM"], "rope_scaling": None}
    assert ModelConfig.from_dict(raw).rotary_dim == 128
    with pytest.raises(ModelConfigError, match="partial_rotary_factor 0.5 is not supported for"):
        ModelConfig.from_dict({**raw, "partial_rotary_factor": 0.5})


def test_aliases_defaults_and_model_type():
    # no architectures: the model_type; "yarn" is LongRoPE for Phi3Config; no original length:
    # Phi3Config's 4096
    raw = phi4_rope(type="yarn")
    del raw["architectures"], raw["original_max_position_embeddings"]
    cfg = ModelConfig.from_dict(raw)
    assert cfg.architecture == "Phi3ForCausalLM" and cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096
    # attention_bias / mlp_bias: Phi3's layers have none (transformers reads neither)
    biased = ModelConfig.from_dict(phi4(attention_bias=True, mlp_bias=True))
    assert not (biased.qkv_bias or biased.o_bias or biased.mlp_bias)
    # a given attention_factor is taken as it is; a Phi-3 without rope scaling rotates plainly
    assert (
        ModelConfig.from_dict(phi4_rope(attention_factor=1.0)).rope_scaling["attention_factor"]
        == 1.0
    )
    plain = ModelConfig.from_dict(phi4(rope_scaling=None))
    assert plain.rope_scaling["rope_type"] == "default" and plain.rotary_dim == 96


def test_quantized_phi3_is_refused_at_build():
    from batchrun.models.loader import build_model
    from batchrun.quant.online import with_quantization

    small = phi4(num_hidden_layers=1, vocab_size=64, hidden_size=256, intermediate_size=512)
    small.update(num_attention_heads=2, num_key_value_heads=1)
    cfg = with_quantization(ModelConfig.from_dict(small), "fp8", "/models/phi4")
    with pytest.raises(ModelConfigError, match="Phi3ForCausalLM with quantization .* fused qkv"):
        build_model(cfg, torch.float32, "cpu", 64)
