"""Mistral-Nemo-Instruct-2407's config.json (head_dim 128 where hidden / heads is 160, no
window, a 1M-token context) resolves to its shapes and to transformers' parameter count."""

from __future__ import annotations

import pytest
import torch

from batchrun.errors import ModelConfigError
from batchrun.models.config import ModelConfig
from batchrun.models.param_count import count_params
from batchrun.parallel.partition import partition_model

# mistralai/Mistral-Nemo-Instruct-2407's config.json
MISTRAL_NEMO_INSTRUCT_2407 = {
    "architectures": ["MistralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 1024000,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 131072,
}
TOTAL = 12_247_782_400  # the model card's 12.2 B


def test_mistral_nemo_resolves_with_its_own_head_dim():
    cfg = ModelConfig.from_dict(MISTRAL_NEMO_INSTRUCT_2407)
    assert cfg.architecture == "MistralForCausalLM"
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (5120, 32, 8, 128)
    assert cfg.num_heads * cfg.head_dim == 4096 != cfg.hidden_size
    assert cfg.rotary_dim == 128 and not cfg.tie_word_embeddings
    assert cfg.sliding_windows == ()
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.qk_norm)
    counts = count_params(cfg)
    assert counts.total == counts.active == TOTAL
    part = partition_model(cfg, 1, 2)
    assert (part.num_heads, part.num_kv_heads) == (16, 4)


def test_mistral_nemo_count_equals_transformers():
    import transformers

    hf_cfg = transformers.MistralConfig(**MISTRAL_NEMO_INSTRUCT_2407)
    with torch.device("meta"):
        hf = transformers.MistralForCausalLM(hf_cfg)
    assert sum(p.numel() for p in hf.parameters()) == TOTAL
    layer = hf.model.layers[0].self_attn
    assert (layer.q_proj.out_features, layer.k_proj.out_features) == (4096, 1024)


def test_a_window_that_is_not_a_count_is_refused_by_name():
    raw = dict(MISTRAL_NEMO_INSTRUCT_2407, sliding_window="4096")
    with pytest.raises(ModelConfigError, match="sliding_window"):
        ModelConfig.from_dict(raw)
