"""Gemma 3 configs: the real models' config.json (gemma-3-1b-it, gemma-3-4b-it, written as dicts
in tests/gemma3_configs.py) resolve to the right shapes, per-layer windows
and rotaries, and parameter counts (equal to transformers' models of those configs); the
transformers 5 form of a config resolves as the hub's; what does not run is refused by name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gemma3_configs import GEMMA3_1B_IT, GEMMA3_4B_IT  # noqa: E402

from batchrun.errors import ModelConfigError  # noqa: E402
from batchrun.models.config import ModelConfig  # noqa: E402
from batchrun.models.param_count import count_params  # noqa: E402

# name -> (config.json, layers, hidden, heads, KV heads, MLP width, vocabulary, window,
#          full-layer rope scaling, parameters of the text model)
REAL = {
    "gemma-3-1b-it": (
        GEMMA3_1B_IT, 26, 1152, 4, 1, 6912, 262_144, 512, {"rope_type": "default"}, 999_885_952,
    ),
    "gemma-3-4b-it": (
        GEMMA3_4B_IT, 34, 2560, 8, 4, 10240, 262_208, 1024,
        {"rope_type": "linear", "factor": 8.0}, 3_880_263_168,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", REAL)
def test_real_configs_resolve(name):
    raw, layers, hidden, heads, kv_heads, width, vocab, window, scaling, params = REAL[name]
    cfg = ModelConfig.from_dict(raw)
    assert cfg.architecture == raw["architectures"][0]
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
        layers, hidden, heads, kv_heads,
    )  # fmt: skip
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.head_dim) == (width, vocab, 256)
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.embed_scale and cfg.norm_plus_one and cfg.sandwich_norms
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias)
    assert cfg.query_pre_attn_scalar == 256 and cfg.eos_token_ids == (1, 106)
    # every sixth layer attends over the whole context, the others over the window
    assert cfg.sliding_windows == tuple(0 if (i + 1) % 6 == 0 else window for i in range(layers))
    assert cfg.rope_theta == 1e6 and cfg.local_rope_theta == 1e4
    assert cfg.rope_scaling == scaling
    assert cfg.torch_dtype == "bfloat16" and cfg.quantization is None
    assert count_params(cfg).total == params


@pytest.mark.parametrize("name", REAL)
def test_counts_equal_transformers_models(name):
    """batchrun's count of the text model equals transformers' (the vision tower left out)."""
    import transformers

    raw = REAL[name][0]
    if "text_config" in raw:
        hf_cfg = transformers.Gemma3Config(**raw)
        with torch.device("meta"):
            hf = transformers.Gemma3ForConditionalGeneration(hf_cfg)
        named = hf.named_parameters()
        hf_count = sum(p.numel() for n, p in named if "language_model" in n)
    else:
        hf_cfg = transformers.Gemma3TextConfig(**raw)
        with torch.device("meta"):
            hf = transformers.Gemma3ForCausalLM(hf_cfg)
        hf_count = sum(p.numel() for p in hf.parameters())  # lm_head tied: counted once
    assert count_params(ModelConfig.from_dict(raw)).total == hf_count


def test_the_transformers_5_form_resolves_as_the_hubs():
    """transformers 5 writes layer_types and rope_parameters (a dict per layer type) where the
    hub's configs have sliding_window_pattern, rope_theta, rope_local_base_freq, rope_scaling."""
    import transformers

    for raw in (GEMMA3_1B_IT, GEMMA3_4B_IT):
        hf_cfg = (
            transformers.Gemma3Config(**raw)
            if "text_config" in raw
            else transformers.Gemma3TextConfig(**raw)
        )
        saved = hf_cfg.to_dict() | {"architectures": raw["architectures"]}
        text = saved.get("text_config", saved)
        assert "layer_types" in text and "full_attention" in text["rope_parameters"]
        assert ModelConfig.from_dict(saved) == ModelConfig.from_dict(raw)


def test_model_type_alone_picks_the_architecture():
    for raw, arch in ((GEMMA3_1B_IT, "Gemma3ForCausalLM"),
                      (GEMMA3_4B_IT, "Gemma3ForConditionalGeneration")):  # fmt: skip
        bare = {k: v for k, v in raw.items() if k != "architectures"}
        assert ModelConfig.from_dict(bare).architecture == arch


def test_layer_types_set_the_windows():
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    raw = {**GEMMA3_1B_IT, "num_hidden_layers": 4, "layer_types": types}
    assert ModelConfig.from_dict(raw).sliding_windows == (0, 512, 512, 0)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0 is not supported"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0 is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention True is not"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported for Gemma3"),
        ({"rope_scaling": {"rope_type": "ntk", "factor": 4.0}}, "rope type 'ntk' is not sup"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "the sliding layers' rope type 'linear' is not supported "
            "\\(rope_parameters.sliding_attention\\); supported: default",
        ),
        ({"layer_types": ["full_attention"] * 3}, "layer_types must list 26 layers"),
        ({"layer_types": ["chunked_attention"] * 26}, "\\['chunked_attention'\\]"),
        ({"sliding_window_pattern": 0}, "sliding_window_pattern must be >= 1; got 0"),
        ({"sliding_window": None}, "sliding_window must be >= 1 for its sliding layers"),
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
            "a quantized Gemma 3 checkpoint .* is not supported",
        ),
    ],
)
def test_refusals_name_the_field(changes, match):
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_dict({**GEMMA3_1B_IT, **changes})


def test_refusals_in_text_config_name_it():
    raw = {
        **GEMMA3_4B_IT,
        "text_config": {**GEMMA3_4B_IT["text_config"], "final_logit_softcapping": 30.0},
    }
    with pytest.raises(ModelConfigError, match="config.json text_config: final_logit_softcapping"):
        ModelConfig.from_dict(raw)
    with pytest.raises(ModelConfigError, match="needs text_config"):
        ModelConfig.from_dict({k: v for k, v in GEMMA3_4B_IT.items() if k != "text_config"})
