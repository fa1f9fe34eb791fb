"""gpt-oss on the CPU equals transformers (fp32): prefill logits and >= 64 greedy tokens of
prompts longer than the sliding window, the experts read from plain and from MXFP4 checkpoints;
and its greedy tokens do not depend on the radix cache or the chunked prefill size."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gptoss_models import GPT_OSS_WINDOW, save_mxfp4  # noqa: E402
from tiny_models import hf_greedy, make_tiny_model, random_prompts  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

NEW_TOKENS = 64


def engine(path: Path, **overrides) -> Engine:
    base = dict(model=str(path), device="cpu", dtype="float32", kv_budget=8192)
    return Engine(EngineConfig(**{**base, **overrides}))


@pytest.fixture(scope="module", params=["plain", "mxfp4"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"gpt_oss_{request.param}")
    hf = make_tiny_model("gpt_oss", path)
    if request.param == "mxfp4":
        save_mxfp4(hf, path)  # hf's experts become what the MXFP4 dequantizes to
    return request.param, path, hf, engine(path)


def test_prefill_logits_match(tiny):
    _, _, hf, eng = tiny
    for prompt in random_prompts(3, seed=1, min_len=2 * GPT_OSS_WINDOW, max_len=60):
        ours = eng.score(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        rel = (ours - ref).norm() / ref.norm()
        assert rel <= 1e-4, f"relative error {rel:.2e}"
    eng.check_integrity()


def test_greedy_tokens_match_hf_generate(tiny):
    _, _, hf, eng = tiny
    prompts = random_prompts(4, seed=2, min_len=GPT_OSS_WINDOW + 1)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    results = {r.rid: r for r in eng.generate(reqs)}
    for i, prompt in enumerate(prompts):
        got = results[str(i)]
        assert got.completion_tokens == NEW_TOKENS and got.finish_reason == "length"
        assert got.output_ids == hf_greedy(hf, prompt, NEW_TOKENS), f"prompt {i}"
    eng.check_integrity()


def workload() -> list[GenerateRequest]:
    """Prompts sharing 30-token prefixes (radix hits past the window) and unrelated ones."""
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(4, seed=5, min_len=10, max_len=70)
    prompts += [prompts[0][:30] + p[:9] for p in prompts[1:]]
    return [GenerateRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]


def test_radix_and_chunk_sizes_give_the_same_tokens(tiny):
    kind, path, _, _ = tiny
    if kind != "plain":
        pytest.skip("the schedule does not depend on the checkpoint's format")
    outs = []
    for overrides in [
        dict(enable_radix_cache=False, max_running=1, chunked_prefill_size=None),
        dict(enable_radix_cache=True, chunked_prefill_size=16),
        dict(enable_radix_cache=False, chunked_prefill_size=7),
        dict(enable_radix_cache=True, chunked_prefill_size=None),
    ]:
        eng = engine(path, **overrides)
        outs.append({r.rid: r.output_ids for r in eng.generate(workload())})
        eng.check_integrity()
    assert all(out == outs[0] for out in outs[1:])
