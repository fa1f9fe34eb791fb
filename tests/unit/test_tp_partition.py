"""Tensor-parallel partition and sharded loading, in one process (no torch.distributed): each
rank's parameters are exactly its slices of the TP=1 parameters, from safetensors and from dummy
weights, and models that cannot split say why."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_tiny_model  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.models.config import ModelConfig, ModelConfigError  # noqa: E402
from batchrun.models.loader import load_model  # noqa: E402
from batchrun.parallel.partition import partition_model  # noqa: E402
from batchrun.parallel.state import TPGroup  # noqa: E402


def model_config(heads=8, kv_heads=2, inter=128, vocab=259, tied=False) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["Qwen2ForCausalLM"],  # qkv bias
            "vocab_size": vocab,
            "hidden_size": 64,
            "intermediate_size": inter,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": 8,
            "tie_word_embeddings": tied,
        }
    )


def test_heads_and_kv_heads_per_rank():
    # the docstring's table: H=8, KV=2, tp=4 -> q heads in pairs, KV heads replicated twice
    parts = [partition_model(model_config(8, 2), r, 4) for r in range(4)]
    assert [(p.head_start, p.num_heads) for p in parts] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [(p.kv_head_start, p.num_kv_heads) for p in parts] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    # KV heads that divide: split
    parts = [partition_model(model_config(8, 4), r, 2) for r in range(2)]
    assert [(p.kv_head_start, p.num_kv_heads) for p in parts] == [(0, 2), (2, 2)]
    # vocab 259 over 2 ranks: 130 rows each, the last one padding on rank 1
    specs = [partition_model(model_config(), r, 2).vocab_spec() for r in range(2)]
    assert [s.runs[0][:] for s in specs] == [(0, 0, 130), (130, 0, 129)]


@pytest.mark.parametrize(
    "heads,kv_heads,inter,tp,match",
    [
        (6, 2, 128, 4, "6 attention heads do not split evenly over 4"),
        (6, 3, 128, 2, "3 KV heads do not split evenly over 2"),
        (12, 3, 128, 4, "multiple of 3"),
        (8, 2, 100, 8, "MLP width 100"),
    ],
)
def test_models_that_do_not_split(heads, kv_heads, inter, tp, match):
    with pytest.raises(ModelConfigError, match=match):
        partition_model(model_config(heads, kv_heads, inter), 0, tp)


def test_engine_config_checks_tp_fields():
    EngineConfig(tp_size=2, tp_rank=1).validate()
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        EngineConfig(tp_size=0).validate()
    with pytest.raises(ValueError, match="tp_rank must be in"):
        EngineConfig(tp_size=2, tp_rank=2).validate()


def assert_rank_holds_its_slices(full, ranks) -> None:
    full_params = dict(full.named_parameters())
    for model in ranks:
        specs = model.param_shards()
        for name, p in model.named_parameters():
            spec = specs.get(name)
            if spec is None:  # replicated: norms, q/k norms
                assert torch.equal(p, full_params[name]), name
                continue
            for run in spec.runs:
                mine = p.narrow(spec.dim, run.local_start, run.length)
                ref = full_params[name].narrow(spec.dim, run.full_start, run.length)
                assert torch.equal(mine, ref), (name, run)
            pad = p.shape[spec.dim] - spec.local_len
            assert not p.narrow(spec.dim, spec.local_len, pad).any(), name  # zero padding


def load(model_dir, cfg: ModelConfig, load_format: str, tp: TPGroup):
    return load_model(model_dir, cfg, load_format, torch.float32, "cpu", 64, seed=3, tp=tp)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_dummy_weights_are_tp1_weights_sliced(kv_heads):
    cfg = model_config(8, kv_heads, tied=kv_heads == 1)
    full = load(None, cfg, "dummy", TPGroup())
    ranks = [load(None, cfg, "dummy", TPGroup(r, 2)) for r in range(2)]
    assert ranks[1].embed_tokens.weight.shape[0] == 130
    assert_rank_holds_its_slices(full, ranks)
    if kv_heads == 1:  # both ranks hold KV head 0
        qkv = [m.layers[0].self_attn.qkv_proj.weight for m in ranks]
        assert torch.equal(qkv[0][32:], qkv[1][32:])


def test_safetensors_shards_are_tp1_weights_sliced(tmp_path):
    make_tiny_model("qwen2", tmp_path)  # qkv bias; 4 heads, 2 KV heads, vocab 256
    cfg = ModelConfig.from_dir(tmp_path)
    full = load(tmp_path, cfg, "safetensors", TPGroup())
    ranks = [load(tmp_path, cfg, "safetensors", TPGroup(r, 2)) for r in range(2)]
    assert ranks[0].layers[0].self_attn.qkv_proj.bias.shape == (32 + 16 + 16,)
    assert ranks[0].layers[0].mlp.down_proj.weight.shape == (64, 64)
    assert_rank_holds_its_slices(full, ranks)
