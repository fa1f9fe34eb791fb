"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5 / Qwen3.6 dense and MoE, text and
multimodal checkpoints; tests/hybrid_models.py) against transformers in fp32 on the CPU:
prefill logits within a relative error of 1e-4 (the plain-torch delta rule and conv in fp32
differ from transformers' by rounding, ~1e-6), and greedy tokens equal for 32 tokens on 8
prompts of mixed lengths run as one batch (mixed prefill and decode steps: every request equal
to transformers' run of it alone). For one model: chunked prefill at several chunk sizes (2
splits the conv's window of 3 inputs) and retraction with re-admission give the same tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybrid_models import KINDS, make_hybrid_model  # noqa: E402
from tiny_models import hf_greedy, random_prompts  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.errors import ModelConfigError, WeightLoadError  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

NEW_TOKENS = 32
# mixed lengths: shorter than the conv's window, inside one delta-rule chunk (64), at its end,
# past it
LENGTHS = (2, 3, 9, 26, 38, 64, 65, 100)
_G = torch.Generator().manual_seed(2)
PROMPTS = [torch.randint(3, 256, (n,), generator=_G).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kind -> (checkpoint path, HF model, HF's greedy tokens of PROMPTS), made on first use."""
    made: dict = {}

    def get(kind: str):
        if kind not in made:
            path = tmp_path_factory.mktemp(kind)
            hf = make_hybrid_model(kind, path)
            made[kind] = path, hf, [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
        return made[kind]

    return get


@pytest.fixture(params=KINDS)
def tiny(request, saved):
    return saved(request.param)


def engine_of(path, **changes) -> Engine:
    fields = {"device": "cpu", "dtype": "float32", "kv_budget": 8192, **changes}
    return Engine(EngineConfig(model=str(path), **fields))


def greedy(engine: Engine, prompts=PROMPTS) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    results = {r.rid: r for r in engine.generate(reqs)}
    engine.check_integrity()
    return [results[str(i)].output_ids for i in range(len(prompts))]


def test_prefill_logits_match(tiny):
    path, hf, _ = tiny
    engine = engine_of(path)
    for prompt in random_prompts(2, seed=1, min_len=8, max_len=150):
        ours = engine.score(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        rel = (ours - ref).norm() / ref.norm()
        assert rel <= 1e-4, f"relative error {rel:.2e}"


def test_greedy_tokens_match_hf(tiny):
    path, _, refs = tiny
    assert greedy(engine_of(path, chunked_prefill_size=48)) == refs


@pytest.fixture
def dense(saved):
    path, _, refs = saved("qwen3_5_text")
    return path, refs


@pytest.mark.parametrize("chunk", [2, 5, None])
def test_chunked_prefill_carries_the_state(dense, chunk):
    path, refs = dense
    assert greedy(engine_of(path, chunked_prefill_size=chunk)) == refs


def test_retraction_and_readmission_keep_the_tokens(dense):
    path, refs = dense
    engine = engine_of(path, kv_budget=400, new_token_ratio=0.05)
    assert greedy(engine) == refs
    assert engine.scheduler.num_retractions > 0


def test_unknown_layer_type_is_refused(tmp_path):
    make_hybrid_model("qwen3_5_text", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["layer_types"][1] = "sliding_attention"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match="sliding_attention"):
        engine_of(tmp_path)


def test_missing_linear_layer_weight_is_refused(tmp_path):
    make_hybrid_model("qwen3_next", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.2.linear_attn.A_log"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match="A_log"):
        engine_of(tmp_path)


def test_fp8_kv_cache_applies_to_the_full_attention_layers(dense):
    path, _ = dense
    engine = engine_of(path, kv_cache_dtype="fp8_e4m3")
    pool = engine.runner.kv_pool
    full = engine.model_config.kv_layers
    assert full == (1, 4)
    assert len(pool.k_buffers) == len(full)  # the linear layers own no KV buffer
    assert all(buf.dtype == torch.float8_e4m3fn for buf in pool.k_buffers + pool.v_buffers)
    prompt = PROMPTS[-1]
    plain = engine_of(path).score(prompt)
    rel = float((engine.score(prompt) - plain).norm() / plain.norm())
    assert 1e-6 < rel < 5e-2, rel


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe"])
def test_parameter_count_is_the_checkpoints(kind, tmp_path):
    from batchrun.models.config import ModelConfig
    from batchrun.models.param_count import count_params

    hf = make_hybrid_model(kind, tmp_path)
    text = [v.numel() for k, v in hf.state_dict().items() if "visual" not in k]
    assert count_params(ModelConfig.from_dir(tmp_path)).total == sum(text)
