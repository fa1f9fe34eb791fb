"""Gemma 4 on the engine (fp32, CPU, the torch attention) against transformers' modeling_gemma4,
on tiny random checkpoints (tests/gemma4_models.py): dense (per-layer head dims and KV heads,
attention_k_eq_v, proportional rope, softcapped logits), MoE, the E-model (per-layer inputs,
KV-shared layers with a double-wide MLP) and the conditional-generation checkpoint in the
shipped config form. Prompts and generations run past the sliding window.

Tolerance: fp32 logits within 1e-4 of transformers' relative to their norm (the same
operations in another order: the experts' sums, the attention's kernels)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gemma4_models import KINDS, WINDOW, make_gemma4  # noqa: E402
from tiny_models import random_prompts  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.engine.kv_pool import KVPool  # noqa: E402
from batchrun.engine_process.tp_launcher import start_tp_engine  # noqa: E402
from batchrun.models.context import kv_bytes_per_token  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

LOGITS_RTOL = 1e-4
NEW = 32


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_gemma4(request.param, path)
    return request.param, hf, str(path)


def engine_config(model_dir: str, **kw) -> EngineConfig:
    return EngineConfig(
        **{"model": model_dir, "device": "cpu", "dtype": "float32", "kv_budget": 8192, **kw}
    )


def greedy(engine: Engine, prompts: list[list[int]], new: int = NEW) -> dict[str, list[int]]:
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    out = {}
    for res in engine.generate(reqs):
        assert res.finish_reason == "length" and not res.error, res
        out[res.rid] = res.output_ids
    engine.check_integrity()
    return out


def shared_prefix_prompts() -> list[list[int]]:
    """Groups sharing a 30-token prefix (radix hits past the window) and unrelated prompts."""
    prompts = random_prompts(5, seed=11, min_len=20, max_len=70)
    return prompts + [prompts[0][:30] + p[:12] for p in prompts[1:5]]


def test_logits_match_transformers(tiny):
    _, hf, model_dir = tiny
    engine = Engine(engine_config(model_dir))
    for prompt in random_prompts(4, seed=1, min_len=8, max_len=60):
        ours = engine.score(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        rel = float((ours - ref).norm() / ref.norm())
        assert rel <= LOGITS_RTOL, f"relative error {rel:.2e}"
    engine.check_integrity()


def hf_greedy_tokens(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation (generate, with its cache): n tokens, the end-of-text
    token among them as the engine's ignore_eos lets it through (no stop, no suppression)."""
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_greedy_tokens_match_transformers(tiny):
    _, hf, model_dir = tiny
    prompts = random_prompts(8, seed=2, min_len=4, max_len=40)
    assert sum(len(p) > WINDOW for p in prompts) >= 4
    out = greedy(Engine(engine_config(model_dir)), prompts)
    for i, prompt in enumerate(prompts):
        assert out[str(i)] == hf_greedy_tokens(hf, prompt, NEW), f"prompt {i}"


def test_chunked_prefill_and_prefix_hits_give_the_same_tokens(tiny):
    kind, _, model_dir = tiny
    if kind == "mm":
        pytest.skip("the same text model as e-model")
    prompts = shared_prefix_prompts()
    plain = dict(enable_radix_cache=False, max_running=1, chunked_prefill_size=None)
    ref = greedy(Engine(engine_config(model_dir, **plain)), prompts, 12)
    engine = Engine(engine_config(model_dir))
    assert greedy(engine, prompts, 12) == ref
    assert engine.stats.cached_tokens >= 30
    for chunk in (5, WINDOW + 1):  # chunks inside and across the window
        chunked = Engine(engine_config(model_dir, chunked_prefill_size=chunk))
        assert greedy(chunked, prompts, 12) == ref


def test_kv_pools_hold_the_layers_that_write_kv(tiny):
    """KV-shared layers own no buffers; the full layers' buffers are the full pool's and the
    sliding layers' the window pool's (engine/window_pool.py), each at its layer's heads and dims
    and at zero heads in the other pool; the pools' bytes a token add up to plan's."""
    kind, _, model_dir = tiny
    engine = Engine(engine_config(model_dir))
    cfg, pool, window = engine.model_config, engine.runner.kv_pool, engine.runner.window_pool
    shared = 3 if kind in ("e-model", "mm") else 0
    assert len(pool.k_buffers) == len(window.k_buffers) == len(cfg.kv_layers)
    assert len(cfg.kv_layers) == cfg.num_layers - shared
    for i, layer in enumerate(cfg.kv_layers):
        mine, other = (window, pool) if cfg.window(layer) > 0 else (pool, window)
        assert tuple(mine.k_buffers[i].shape[1:]) == (
            cfg.kv_heads_of(layer),
            cfg.head_dim_of(layer),
        )
        assert other.k_buffers[i].shape[1] == 0
    heads = {tuple(b.shape[1:]) for b in pool.k_buffers + window.k_buffers if b.shape[1]}
    assert {(2, 16), (1 if kind in ("dense", "moe") else 2, 32)} == heads

    def per_slot(p):
        return sum(b[0].numel() * b.element_size() for b in p.k_buffers + p.v_buffers)

    assert per_slot(pool) + per_slot(window) == 2 * kv_bytes_per_token(cfg)  # fp32: 4 bytes
    allocated = sum(b.numel() * b.element_size() for b in pool.k_buffers + pool.v_buffers)
    assert allocated == per_slot(pool) * (pool.num_slots + 1)
    assert KVPool.bytes_per_token_of(engine.runner.model.kv_shapes, torch.float32) == (
        2 * kv_bytes_per_token(cfg)
    )


@pytest.mark.parametrize("kind", ["dense", "moe", "e-model"])
def test_tp2_matches_tp1(kind, tmp_path):
    make_gemma4(kind, tmp_path)
    cfg = engine_config(str(tmp_path), kv_budget=4096, chunked_prefill_size=64)
    prompts = shared_prefix_prompts()
    ref_engine = Engine(cfg)
    ref = greedy(ref_engine, prompts, 8)
    ref_logits = ref_engine.score(prompts[0])
    with start_tp_engine(cfg, tp_size=2, timeout_s=120, check_sync=True) as engine:
        assert greedy(engine, prompts, 8) == ref
        logits = engine.score(prompts[0])
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
