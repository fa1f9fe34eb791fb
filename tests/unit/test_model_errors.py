"""A model directory batchrun cannot run fails at start-up with a message that names the file (and
tensor) and says what to do; `load_format="dummy"` needs only config.json."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_tiny_model  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.models.config import ModelConfig, ModelConfigError  # noqa: E402
from batchrun.models.loader import WeightLoadError  # noqa: E402
from batchrun.models.registry import ARCHITECTURES, MODEL_TYPES  # noqa: E402

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("good")
    make_tiny_model("llama", path)
    return path


@pytest.fixture
def model_dir(good_dir, tmp_path) -> Path:
    """A fresh copy of the good model to break."""
    for name in ("config.json", WEIGHTS):
        shutil.copy(good_dir / name, tmp_path / name)
    return tmp_path


def engine(path: Path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", kv_budget=256, **kw))


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_weights(path: Path, edit) -> None:
    tensors = load_file(str(path / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(path / WEIGHTS))


def test_good_model_loads(model_dir):
    logits = engine(model_dir).score([5, 6, 7])
    assert logits.shape == (3, 256) and torch.isfinite(logits).all()


# -- config.json -------------------------------------------------------------------------------


def test_unsupported_architecture(model_dir):
    edit_config(model_dir, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ModelConfigError) as e:
        engine(model_dir)
    msg = str(e.value)
    assert str(model_dir / "config.json") in msg
    assert "GPT2LMHeadModel" in msg and "unsupported architecture" in msg
    assert "model_type 'gpt2'" in msg
    assert all(arch in msg for arch in ARCHITECTURES)
    assert all(kind in msg for kind in MODEL_TYPES)


def test_model_type_without_architectures_loads(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    del cfg["architectures"]
    (model_dir / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    assert engine(model_dir).model_config.architecture == "LlamaForCausalLM"


def test_config_with_only_a_model_type(model_dir):
    """Says what the file has and lacks; never that a supported model_type is unsupported."""
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelConfigError) as e:
        engine(model_dir)
    msg = str(e.value)
    assert "unsupported" not in msg and "model_type 'llama'" in msg, msg
    assert "lacks vocab_size, hidden_size, intermediate_size, num_hidden_layers" in msg
    (model_dir / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ModelConfigError) as e:
        engine(model_dir)
    msg = str(e.value)
    assert "the file has model_type 'bert'" in msg and "model_type llama, mistral" in msg, msg
    (model_dir / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ModelConfigError, match="neither architectures nor model_type"):
        engine(model_dir)


def test_missing_config_json(model_dir):
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelConfigError) as e:
        engine(model_dir)
    msg = str(e.value)
    assert str(model_dir / "config.json") in msg and "not found" in msg
    assert "*.safetensors" in msg and ".gguf" in msg  # what a model directory should hold


def test_missing_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.*not found"):
        engine(tmp_path / "nowhere")


@pytest.mark.parametrize(
    "rope_keys",
    [
        # transformers 5
        {"rope_parameters": {"rope_type": "ntk", "rope_theta": 1e4, "factor": 4.0}},
        # transformers 4, both spellings of the type
        {"rope_parameters": None, "rope_theta": 1e4, "rope_scaling": {"rope_type": "ntk"}},
        {"rope_parameters": None, "rope_theta": 1e4, "rope_scaling": {"type": "ntk"}},
    ],
)
def test_unsupported_rope_type(model_dir, rope_keys):
    edit_config(model_dir, **rope_keys)
    with pytest.raises(ModelConfigError) as e:
        engine(model_dir)
    msg = str(e.value)
    kind = "ntk"
    assert str(model_dir / "config.json") in msg and f"rope type {kind!r}" in msg
    assert "supported: default, llama3, linear" in msg


@pytest.mark.parametrize(
    "arch, model_type, changes, windows",
    [
        ("MistralForCausalLM", "mistral", {"sliding_window": 8}, (8, 8, 8)),
        (
            "Qwen2ForCausalLM",
            "qwen2",
            {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 2},
            (0, 0, 8),
        ),
        # transformers' Llama has no window: the keys change nothing
        ("LlamaForCausalLM", "llama", {"sliding_window": 8, "use_sliding_window": True}, ()),
    ],
)
def test_a_window_in_use_runs(model_dir, arch, model_type, changes, windows):
    edit_config(model_dir, architectures=[arch], model_type=model_type, **changes)
    eng = engine(model_dir)
    assert eng.model_config.sliding_windows == windows
    assert torch.isfinite(eng.score(list(range(3, 30)))).all()


def test_a_window_that_is_not_a_count_is_refused(model_dir):
    edit_config(model_dir, architectures=["MistralForCausalLM"], sliding_window=0)
    with pytest.raises(ModelConfigError) as e:
        engine(model_dir)
    msg = str(e.value)
    assert str(model_dir / "config.json") in msg and "sliding_window 0 is not a positive" in msg


@pytest.mark.parametrize(
    "arch, model_type, changes",
    [
        ("MistralForCausalLM", "mistral", {"sliding_window": None}),
        ("Qwen2ForCausalLM", "qwen2", {"sliding_window": 32768, "use_sliding_window": False}),
        ("Qwen2ForCausalLM", "qwen2", {"sliding_window": 8}),  # use_sliding_window: false
    ],
)
def test_a_window_that_is_off_runs(model_dir, arch, model_type, changes):
    edit_config(model_dir, architectures=[arch], model_type=model_type, **changes)
    assert torch.isfinite(engine(model_dir).score([5, 6, 7])).all()


def test_unsupported_activation(model_dir):
    edit_config(model_dir, hidden_act="gelu")
    with pytest.raises(ModelConfigError, match="hidden_act 'gelu' is not supported"):
        engine(model_dir)


def test_config_missing_a_field(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    del cfg["hidden_size"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError) as e:
        engine(model_dir)
    assert str(model_dir / "config.json") in str(e.value) and "hidden_size" in str(e.value)


def test_config_not_json(model_dir):
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError) as e:
        engine(model_dir)
    assert str(model_dir / "config.json") in str(e.value) and "JSON" in str(e.value)


# -- weights -----------------------------------------------------------------------------------


def test_no_safetensors(model_dir):
    (model_dir / WEIGHTS).unlink()
    with pytest.raises(WeightLoadError) as e:
        engine(model_dir)
    msg = str(e.value)
    assert f"no *.safetensors in {model_dir}" in msg and "--load-format dummy" in msg


def test_sharded_index_names_a_missing_shard(model_dir):
    names = list(load_file(str(model_dir / WEIGHTS)))
    shard1, shard2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    (model_dir / WEIGHTS).rename(model_dir / shard1)
    weight_map = {n: shard1 for n in names} | {"lm_head.weight": shard2}
    index = model_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(WeightLoadError) as e:
        engine(model_dir)
    msg = str(e.value)
    assert str(index) in msg and shard2 in msg and "1 of 2 shards missing" in msg


def test_sharded_checkpoint_loads(model_dir, good_dir):
    """The happy path of the index: two shards give the same logits as one file."""
    tensors = load_file(str(model_dir / WEIGHTS))
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(model_dir / file))
    (model_dir / WEIGHTS).unlink()
    weight_map = {n: file for file, part in shards.items() for n in part}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    prompt = [9, 8, 7, 6]
    assert torch.equal(engine(model_dir).score(prompt), engine(good_dir).score(prompt))


def test_tensor_of_the_wrong_shape(model_dir):
    name = "model.layers.1.self_attn.k_proj.weight"  # [kv_heads * head_dim, hidden] = [32, 64]

    def edit(t):
        t[name] = torch.zeros(48, 64)

    edit_weights(model_dir, edit)
    with pytest.raises(WeightLoadError) as e:
        engine(model_dir)
    msg = str(e.value)
    assert WEIGHTS in msg and repr(name) in msg
    assert "(48, 64)" in msg and "(32, 64)" in msg


def test_checkpoint_missing_a_tensor(model_dir):
    edit_weights(model_dir, lambda t: t.pop("model.layers.2.mlp.down_proj.weight"))
    with pytest.raises(WeightLoadError) as e:
        engine(model_dir)
    msg = str(e.value)
    assert str(model_dir) in msg and "lacks 1 tensors" in msg
    assert "layers.2.mlp.down_proj.weight" in msg


def test_checkpoint_missing_part_of_a_fused_tensor(model_dir):
    edit_weights(model_dir, lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(WeightLoadError, match="lacks 1 tensors.*layers.0.mlp.gate_up_proj"):
        engine(model_dir)


def test_unexpected_tensor(model_dir):
    def edit(t):
        t["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)  # Qwen3 has it, Llama not

    edit_weights(model_dir, edit)
    with pytest.raises(WeightLoadError) as e:
        engine(model_dir)
    msg = str(e.value)
    assert WEIGHTS in msg and "model.layers.0.self_attn.q_norm.weight" in msg
    assert "config.json matches the weights" in msg


@pytest.mark.parametrize(
    "content",
    [
        b"version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 4242\n",  # LFS pointer
        b"\x00" * 7,
    ],
)
def test_unreadable_safetensors_file(model_dir, content):
    (model_dir / WEIGHTS).write_bytes(content)
    with pytest.raises(WeightLoadError) as e:
        engine(model_dir)
    assert str(model_dir / WEIGHTS) in str(e.value)


# -- random weights --------------------------------------------------------------------------------


def test_dummy_load_format_needs_only_config_json(model_dir):
    (model_dir / WEIGHTS).unlink()
    eng = engine(model_dir, load_format="dummy")
    logits = eng.score(list(range(3, 40)))
    assert logits.shape == (37, 256) and torch.isfinite(logits).all()
    assert logits.std() > 0
    # seeded: the same config gives the same weights
    again = engine(model_dir, load_format="dummy").score(list(range(3, 40)))
    assert torch.equal(again, logits)


def test_dummy_uniform_draws_every_weight_as_vllm_and_sglang_do(model_dir):
    """dummy_init "uniform": every parameter, the norms too, in U(-1e-3, 1e-3) (vLLM's and
    SGLang's dummy loaders)."""
    from batchrun.models.dummy import UNIFORM_DUMMY_BOUND

    eng = engine(model_dir, load_format="dummy", dummy_init="uniform")
    params = dict(eng.runner.model.named_parameters())
    for name, p in params.items():
        assert p.abs().max() <= UNIFORM_DUMMY_BOUND, name
        assert p.std() > UNIFORM_DUMMY_BOUND / 4, name  # drawn, not left at 0 or 1
    assert any(name.endswith("norm.weight") for name in params)
    assert torch.isfinite(eng.score(list(range(3, 40)))).all()


@pytest.mark.parametrize("kind", ["normal", "uniform"])
def test_init_dummy_draws_by_kind(kind):
    """init_dummy_ on any module: "normal" draws normal(0, 0.02) with the norms at 1,
    "uniform" every parameter from U(-1e-3, 1e-3); the same seed, the same weights."""
    from batchrun.layers.norm import RMSNorm
    from batchrun.models.dummy import UNIFORM_DUMMY_BOUND, init_dummy_

    def module():
        m = torch.nn.Module()
        m.proj = torch.nn.Linear(64, 256, bias=False)
        m.norm = RMSNorm(64, 1e-5, torch.float32, "cpu")
        return m

    a, b = module(), module()
    init_dummy_(a, kind, seed=3)
    init_dummy_(b, kind, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    if kind == "uniform":
        assert a.norm.weight.abs().max() <= UNIFORM_DUMMY_BOUND
        assert a.proj.weight.abs().max() <= UNIFORM_DUMMY_BOUND
    else:
        assert torch.equal(a.norm.weight, torch.ones(64))
        assert abs(a.proj.weight.std().item() - 0.02) < 0.002


def test_an_unknown_dummy_init_fails_validation_with_the_choices(model_dir):
    with pytest.raises(ValueError, match="dummy_init must be one of normal, uniform; got 'zeros'"):
        EngineConfig(load_format="dummy", dummy_init="zeros").validate()
    with pytest.raises(ValueError, match="normal, uniform"):
        engine(model_dir, load_format="dummy", dummy_init="zeros")


def test_model_config_reads_transformers_5_rope_parameters(tmp_path):
    raw = json.loads(json.dumps(dict(
        architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    )))  # fmt: skip
    cfg = ModelConfig.from_dict(raw)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 16
