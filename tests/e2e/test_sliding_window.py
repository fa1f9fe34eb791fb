"""Sliding-window attention on the CPU (fp32, torch backend): greedy tokens and prefill logits
equal HF transformers for a Mistral whose every layer has window 8 and a Qwen2 with
use_sliding_window whose layers past max_window_layers have it (a model of windowed and full
layers), on prompts far longer than the window; and the tokens do not depend on the radix
cache, the chunked-prefill size (chunks shorter and longer than the window) or --tp 2.

The Triton kernels' windows: tests/unit/test_window_interpreter.py (CPU) and
tests/gpu/test_kernels.py; FlashInfer's FA3 prefill: tests/gpu/test_fa3_prefill.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import hf_greedy, make_tiny_model, random_prompts  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.models.config import ModelConfig  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

KINDS = ["mistral-window", "qwen2-window"]
WINDOWS = {"mistral-window": (8, 8, 8), "qwen2-window": (0, 8, 8)}
NEW_TOKENS = 64


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(request.param, path)
    return request.param, hf, str(path)


def engine(model_dir: str, **kw) -> Engine:
    cfg = dict(model=model_dir, device="cpu", dtype="float32", kv_budget=8192)
    return Engine(EngineConfig(**{**cfg, **kw}))


def test_the_config_gives_each_layer_its_window(tiny):
    kind, _, model_dir = tiny
    assert ModelConfig.from_dir(model_dir).sliding_windows == WINDOWS[kind]


def test_prefill_logits_match(tiny):
    _, hf, model_dir = tiny
    eng = engine(model_dir)
    for prompt in random_prompts(3, seed=1, min_len=20, max_len=70):
        ours = eng.score(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        rel = (ours - ref).norm() / ref.norm()
        assert rel <= 1e-4, f"relative error {rel:.2e}"
    eng.check_integrity()


def test_greedy_tokens_match_hf_generate(tiny):
    """Prompts of 12-40 tokens and 64 new ones: every decode step past the window."""
    _, hf, model_dir = tiny
    eng = engine(model_dir)
    prompts = random_prompts(4, seed=2, min_len=12)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    results = {r.rid: r for r in eng.generate(GenerateRequest(str(i), p, params)
                                              for i, p in enumerate(prompts))}  # fmt: skip
    for i, prompt in enumerate(prompts):
        got = results[str(i)]
        assert got.completion_tokens == NEW_TOKENS and got.finish_reason == "length"
        assert got.output_ids == hf_greedy(hf, prompt, NEW_TOKENS), f"prompt {i}"
    eng.check_integrity()


def workload() -> list[GenerateRequest]:
    """Prompts sharing a 30-token prefix (radix hits past the window) and unrelated ones."""
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(5, seed=3, min_len=10, max_len=90)
    prompts += [prompts[0][:30] + p[:10] for p in prompts[1:4]]
    return [GenerateRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]


def greedy(eng: Engine) -> dict[str, list[int]]:
    out = {}
    for res in eng.generate(workload()):
        assert res.finish_reason == "length" and not res.error, res
        out[res.rid] = res.output_ids
        eng.check_integrity()
    return out


def test_radix_cache_and_chunk_sizes_give_the_same_tokens(tiny):
    _, _, model_dir = tiny
    ref = greedy(engine(model_dir, enable_radix_cache=False, max_running=1,
                        chunked_prefill_size=None))  # fmt: skip
    cached = engine(model_dir)
    assert greedy(cached) == ref
    assert cached.stats.cached_tokens >= 3 * 30, "the shared prefix was not reused"
    for chunk in (5, 8, 13, 64):  # shorter than, equal to and longer than the window
        assert greedy(engine(model_dir, chunked_prefill_size=chunk)) == ref, chunk


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_matches_tp1(kind, tmp_path):
    from batchrun.engine_process.tp_launcher import start_tp_engine

    model_dir = tmp_path / kind
    make_tiny_model(kind, model_dir)
    assert json.loads((model_dir / "config.json").read_text())["sliding_window"] == 8
    cfg = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", kv_budget=4096,
                       chunked_prefill_size=16)  # fmt: skip
    ref = greedy(Engine(cfg))
    with start_tp_engine(cfg, tp_size=2, timeout_s=120, check_sync=True) as eng:
        assert eng.runner.kv_pool.k_buffers[0].shape[1] == 1  # 2 KV heads split in two
        assert greedy(eng) == ref
