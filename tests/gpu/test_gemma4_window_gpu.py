"""Gemma 4's window pool on CUDA (engine/window_pool.py, attention/windowed.py): the tiny models
with the default kernels (Triton attention, CUDA-graph decode, overlap), the sliding layers
keeping only their window, give transformers' greedy tokens in fp32, with chunks inside and
across the window, with retractions, and with the radix cache on over prompts that share stems
longer than the window (the tree's window slots, engine/window_tree.py); the pool is sized from
free memory (the budget's split) as well as from kv_budget."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchrun.config import EngineConfig, KernelPlan  # noqa: E402
from batchrun.engine import window_pool  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NEW = 32


def hf_greedy(hf, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            logits = hf(torch.tensor([ids], device="cuda")).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("kind", ["dense", "e-model"])
@pytest.mark.parametrize(
    "sizes",
    [
        dict(kv_budget=8192, chunked_prefill_size=None),
        dict(kv_budget=8192, chunked_prefill_size=5),
        dict(kv_budget=8192, chunked_prefill_size=13),  # across the window (12)
        dict(kv_budget=120, chunked_prefill_size=16, max_running=4),  # retractions
        dict(kv_budget=None, chunked_prefill_size=16, gpu_memory_utilization=0.02),  # free memory
        dict(kv_budget=8192, chunked_prefill_size=16, enable_radix_cache=True),
    ],
    ids=["whole", "chunk5", "chunk13", "retract", "free-memory", "radix"],
)
def test_tiny_gemma4_with_windows_equals_transformers(kind, sizes, tmp_path, monkeypatch):
    from gemma4_models import make_gemma4
    from tiny_models import random_prompts

    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    monkeypatch.setattr(window_pool, "FREE_STRIDE", 1)  # free behind the window every step
    hf = make_gemma4(kind, tmp_path).cuda()
    base = dict(model=str(tmp_path), device="cuda", dtype="float32", enable_radix_cache=False,
                overlap=True)  # fmt: skip
    config = EngineConfig(**{**base, **sizes})
    engine = Engine(config, kernels=KernelPlan())
    assert engine.kernels.attention == "triton" and engine.runner.window is not None
    assert engine.runner.graphs is not None  # the decode steps replay CUDA graphs
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(8, seed=5, min_len=4, max_len=60)
    if config.enable_radix_cache:  # two stems longer than the window (12), a stem and a cut
        stem = prompts[0] + prompts[1]
        prompts = [stem[: len(stem) // 2 + 3] + p[:7] if i % 2 else stem + p[:9]
                   for i, p in enumerate(prompts)]  # fmt: skip
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    got = {r.rid: r.output_ids for r in engine.generate(reqs)}
    engine.check_integrity()
    assert engine.runner.window.num_held == 0
    if sizes.get("kv_budget") == 120:
        assert engine.scheduler.num_retractions > 0
    if config.enable_radix_cache:
        assert engine.stats.cached_tokens > 24, "the shared stems were not reused"
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == hf_greedy(hf, prompt), i
