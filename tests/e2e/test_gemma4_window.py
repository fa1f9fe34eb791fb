"""Gemma 4's sliding layers keep only their window (engine/window_pool.py): greedy tokens equal
transformers' on prompts and generations past the window, unchunked and in chunks inside and
across the window, with a window pool too small for any request's whole sequence (so slots
behind the window must go back), through retractions, and with the radix cache on (the tree's
window slots, engine/window_tree.py): prompts sharing prefixes longer than the window hit the
cache, and a window pool too small to keep every cached window cuts matches back."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gemma4_models import WINDOW, make_gemma4  # noqa: E402
from tiny_models import random_prompts  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine import window_pool  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

NEW = 24
MAX_RUNNING = 3


@pytest.fixture(scope="module", params=["dense", "e-model"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_gemma4(request.param, path)
    prompts = random_prompts(6, seed=5, min_len=10, max_len=45)
    assert sum(len(p) > WINDOW for p in prompts) >= 4
    ref = {str(i): hf_greedy_tokens(hf, p, NEW) for i, p in enumerate(prompts)}
    return request.param, hf, str(path), prompts, ref


@pytest.fixture(autouse=True)
def stride_one(monkeypatch):
    """Free behind the window at every step: the pool then holds the least it can."""
    monkeypatch.setattr(window_pool, "FREE_STRIDE", 1)


def hf_greedy_tokens(hf, prompt: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def windowed_engine(model_dir: str, **kw) -> Engine:
    config = dict(
        model=model_dir, device="cpu", dtype="float32", kv_budget=4096,
        enable_radix_cache=False, max_running=MAX_RUNNING,
    )  # fmt: skip
    engine = Engine(EngineConfig(**{**config, **kw}))
    assert engine.runner.window is not None, "the window pool is off"
    return engine


def greedy(engine: Engine, prompts: list[list[int]]) -> dict[str, list[int]]:
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    out = {}
    for res in engine.generate(reqs):
        assert res.finish_reason == "length" and not res.error, res
        out[res.rid] = res.output_ids
    engine.check_integrity()
    window = engine.runner.window
    assert window.num_held == 0
    kv = getattr(engine, "kv", None)  # None: a tensor-parallel engine (its test runs no cache)
    if kv is None or kv.cache.windows is None:
        assert window.allocator.num_free == window.capacity
    return out


def test_the_pools_split_by_layer_kind(tiny):
    _, _, model_dir, _, _ = tiny
    engine = windowed_engine(model_dir, chunked_prefill_size=8)
    runner, cfg = engine.runner, engine.model_config
    for i, layer in enumerate(cfg.kv_layers):
        sliding = cfg.window(layer) > 0
        assert runner.kv_pool.k_buffers[i].shape[1] == (0 if sliding else cfg.kv_heads_of(layer))
        assert runner.window_pool.k_buffers[i].shape[1] == (
            cfg.kv_heads_of(layer) if sliding else 0
        )
    assert runner.window.capacity == window_pool.window_slots(MAX_RUNNING, WINDOW, 8)
    assert runner.num_slots == 4096  # kv_budget counts the full layers' tokens


@pytest.mark.parametrize("chunk", [None, 5, WINDOW + 1])
def test_greedy_tokens_match_transformers(tiny, chunk):
    """Unchunked, in chunks inside the window and across it. The window pool holds less than
    the running requests' sequences: positions behind the window must go back to it."""
    _, _, model_dir, prompts, ref = tiny
    engine = windowed_engine(model_dir, chunked_prefill_size=chunk)
    if chunk is not None:
        longest = max(len(p) for p in prompts) + NEW
        assert engine.runner.window.capacity < MAX_RUNNING * longest
    assert greedy(engine, prompts) == ref


def test_retraction_keeps_the_tokens(tiny):
    """A full pool too small for the running requests' growth: requests retract and resume."""
    _, _, model_dir, prompts, ref = tiny
    engine = windowed_engine(model_dir, kv_budget=110, chunked_prefill_size=16)
    assert greedy(engine, prompts) == ref
    assert engine.scheduler.num_retractions > 0


def test_score_matches_the_whole_pool(tiny):
    _, hf, model_dir, prompts, _ = tiny
    engine = windowed_engine(model_dir)
    prompt = max(prompts, key=len)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    ours = engine.score(prompt)
    assert float((ours - ref).norm() / ref.norm()) <= 1e-4
    engine.check_integrity()


def test_tp2_matches_tp1(tiny, monkeypatch):
    """Tensor parallelism over gloo: each rank's window pool holds its KV heads of the sliding
    layers; the ranks' window books stay in step (the same scheduler on every rank)."""
    from batchrun.engine_process.tp_launcher import start_tp_engine

    kind, _, model_dir, prompts, ref = tiny
    if kind != "dense":
        pytest.skip("one kind is enough: the pools split the same way")
    # the other ranks' processes free at the default stride: so does rank 0 here
    monkeypatch.setattr(window_pool, "FREE_STRIDE", 32)
    cfg = EngineConfig(
        model=model_dir, device="cpu", dtype="float32", kv_budget=4096, enable_radix_cache=False,
        max_running=MAX_RUNNING, chunked_prefill_size=13,
    )  # fmt: skip
    with start_tp_engine(cfg, tp_size=2, timeout_s=120, check_sync=True) as engine:
        assert engine.runner.window is not None
        assert greedy(engine, prompts) == ref


def shared_prefix_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """The prompts again behind two stems longer than the window (a stem and a cut of it)."""
    stem = prompts[0] + prompts[1]
    assert len(stem) > 2 * WINDOW
    cut = len(stem) // 2 + 3
    return [stem[:cut] + p[:7] if i % 2 else stem + p[:9] for i, p in enumerate(prompts)]


def test_radix_cache_hits_keep_the_tokens(tiny):
    """The radix cache on: shared prefixes are served from the tree, windows included. The
    window pool (sized by kv_budget: the running requests' windows and a step) is short of
    every cached window, so the tree's windows go LRU first and matches are cut back to where
    one is held. Tokens equal transformers', request by request, and again from a warm tree."""
    _, hf, model_dir, prompts, _ = tiny
    prompts = shared_prefix_prompts(prompts)
    ref = {str(i): hf_greedy_tokens(hf, p, NEW) for i, p in enumerate(prompts)}
    engine = windowed_engine(model_dir, enable_radix_cache=True, chunked_prefill_size=16)
    assert engine.kv.cache.windows is not None
    assert greedy(engine, prompts) == ref
    assert engine.stats.cached_tokens > 2 * WINDOW, "the shared stems were not reused"
    assert greedy(engine, prompts) == ref
    # scoring lends window slots: the tree's windows make room
    window = engine.runner.window
    prompt = prompts[0][:40]
    assert window.allocator.num_free < len(prompt) <= window.capacity
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    assert float((engine.score(prompt) - logits).norm() / logits.norm()) <= 1e-4
    engine.check_integrity()
