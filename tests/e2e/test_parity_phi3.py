"""Phi-3 / Phi-4 (Phi3ForCausalLM: fused qkv_proj / gate_up_proj checkpoints, partial rotary,
LongRoPE) on the CPU engine: greedy tokens and prefill logits equal transformers (fp32) with the
short factors (an engine context of at most original_max_position_embeddings) and with the long
ones (a larger context, prompts longer than the original length, where transformers takes the
long factors too); radix cache on / off and chunked-prefill sizes give the same tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import hf_greedy, make_tiny_model, random_prompts  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

NEW_TOKENS = 64
# kind -> (engine context_len, prompt lengths): "phi3"'s original length is 128, so a context of
# 128 takes the short factors; "phi3-long"'s is 16, every prompt longer
CASES = {"phi3": (128, (4, 40)), "phi3-long": (512, (17, 60))}


def engine_config(path: Path, context_len: int, **kw) -> EngineConfig:
    return EngineConfig(
        model=str(path), device="cpu", dtype="float32", kv_budget=8192, context_len=context_len,
        **kw,
    )  # fmt: skip


@pytest.fixture(scope="module", params=list(CASES))
def tiny(request, tmp_path_factory):
    kind = request.param
    path = tmp_path_factory.mktemp(kind)
    hf = make_tiny_model(kind, path)
    context_len, lengths = CASES[kind]
    return kind, path, hf, Engine(engine_config(path, context_len)), lengths


def test_rotary_takes_the_factors_of_the_context(tiny):
    kind, _, hf, engine, _ = tiny
    rotary = engine.runner.model.rotary
    assert rotary.rotary_dim == 8 and rotary.cos_cache.shape[1] == 8  # half of head_dim 16
    hf_rotary = hf.model.rotary_emb
    # transformers' short set is its initial inv_freq; its long set is taken past the original
    original = hf.config.rope_parameters["original_max_position_embeddings"]
    positions = torch.tensor([[original if kind == "phi3-long" else 0]])
    cos, _ = hf_rotary(torch.zeros(1, dtype=torch.float32), positions)
    torch.testing.assert_close(rotary.cos_cache[positions[0]], cos[0], rtol=0, atol=0)


def test_prefill_logits_match(tiny):
    _, _, hf, engine, (low, high) = tiny
    for prompt in random_prompts(3, seed=1, min_len=max(low, 8), max_len=high):
        ours = engine.score(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        rel = (ours - ref).norm() / ref.norm()
        assert rel <= 1e-4, f"relative error {rel:.2e}"
    engine.check_integrity()


def test_greedy_tokens_match_hf_generate(tiny):
    _, _, hf, engine, (low, high) = tiny
    prompts = random_prompts(4, seed=2, min_len=low, max_len=high)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    results = {r.rid: r for r in engine.generate(reqs)}
    for i, prompt in enumerate(prompts):
        got = results[str(i)]
        assert got.completion_tokens == NEW_TOKENS and got.finish_reason == "length"
        assert got.output_ids == hf_greedy(hf, prompt, NEW_TOKENS), f"prompt {i}"
    engine.check_integrity()


def _shared_prefix_workload(lengths) -> list[GenerateRequest]:
    """Prompts sharing a 32-token prefix (radix hits) and others, long ones chunked."""
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    prefix = random_prompts(1, seed=4, min_len=32, max_len=32)[0]
    prompts = random_prompts(4, seed=3, min_len=lengths[0], max_len=lengths[1])
    prompts += [prefix + p[:10] for p in prompts]
    return [GenerateRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]


def test_radix_cache_and_chunk_sizes_give_the_same_tokens(tiny):
    kind, path, _, _, lengths = tiny
    context_len = CASES[kind][0]
    outputs = []
    for radix, chunk in ((False, None), (True, None), (True, 16), (False, 8)):
        engine = Engine(
            engine_config(path, context_len, enable_radix_cache=radix, chunked_prefill_size=chunk)
        )
        out = {r.rid: r.output_ids for r in engine.generate(_shared_prefix_workload(lengths))}
        engine.check_integrity()
        if radix:
            assert engine.stats.cached_tokens > 0
        outputs.append(out)
    assert all(out == outputs[0] for out in outputs[1:])
