"""Greedy tokens and prefill logits of the batchrun engine equal HF transformers (fp32, CPU), for
the dense architectures, the mixtures of experts (tiny_models.MOE_KINDS) and Gemma 3 (its
sliding layers' window is shorter than most prompts)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import MOE_KINDS, hf_greedy, make_tiny_model, random_prompts  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

KINDS = [
    "llama",
    "llama3",
    "qwen2",
    "qwen3",
    "mistral",
    "mistral-nemo",
    "llama-bias",
    "tied",
    *MOE_KINDS,
    # Gemma 3: prompts and generations well past its sliding window (tiny_models.GEMMA3_WINDOW)
    "gemma3",
    "gemma3-mm",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(request.param, path)
    engine = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", kv_budget=8192))
    return request.param, hf, engine


def test_prefill_logits_match(tiny):
    _, hf, engine = tiny
    for prompt in random_prompts(3, seed=1, min_len=8, max_len=60):
        ours = engine.score(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        rel = (ours - ref).norm() / ref.norm()
        assert rel <= 1e-4, f"relative error {rel:.2e}"
    engine.check_integrity()


def test_greedy_tokens_match_hf_generate(tiny):
    _, hf, engine = tiny
    prompts = random_prompts(4, seed=2)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    results = {r.rid: r for r in engine.generate(reqs)}
    for i, prompt in enumerate(prompts):
        got = results[str(i)]
        assert got.completion_tokens == NEW_TOKENS and got.finish_reason == "length"
        assert got.output_ids == hf_greedy(hf, prompt, NEW_TOKENS), f"prompt {i}"
    engine.check_integrity()
