"""A mixture of experts' greedy outputs do not depend on how the engine schedules: radix cache
on/off, chunked prefill of 16 tokens or unlimited, retraction (a KV pool too small for the batch),
overlap scheduling. Each token's experts depend only on its own hidden state, so a batch's other
rows change nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import MOE_KINDS, make_tiny_model  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

# CI's slow tier (BATCHRUN_SLOW_TESTS=1): the three models' schedules take minutes on 2 cores
pytestmark = pytest.mark.slow

NEW = 24


def workload() -> list[GenerateRequest]:
    """12 prompts in 3 groups sharing a 30-token prefix, plus 4 unrelated ones."""
    g = torch.Generator().manual_seed(11)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    reqs = []
    for grp in range(3):
        prefix = torch.randint(3, 256, (30,), generator=g).tolist()
        for q in range(4):
            n = int(torch.randint(1, 15, (1,), generator=g))
            tail = torch.randint(3, 256, (n,), generator=g).tolist()
            reqs.append(GenerateRequest(f"g{grp}q{q}", prefix + tail, params))
    for i in range(4):
        n = int(torch.randint(5, 60, (1,), generator=g))
        reqs.append(
            GenerateRequest(f"u{i}", torch.randint(3, 256, (n,), generator=g).tolist(), params)
        )
    return reqs[::2] + reqs[1::2]


def run(model_dir: str, **overrides) -> tuple[dict[str, list[int]], Engine]:
    base = dict(model=model_dir, device="cpu", dtype="float32", kv_budget=8192)
    engine = Engine(EngineConfig(**{**base, **overrides}))
    out = {}
    for res in engine.generate(workload()):
        assert res.finish_reason == "length", res
        out[res.rid] = res.output_ids
    engine.check_integrity()
    return out, engine


@pytest.fixture(scope="module", params=MOE_KINDS)
def moe(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_model(request.param, path)
    ref, _ = run(str(path), enable_radix_cache=False, max_running=1, chunked_prefill_size=None)
    return str(path), ref


@pytest.mark.parametrize("chunk", [16, None])
def test_radix_and_chunked_prefill(moe, chunk):
    model_dir, ref = moe
    out, engine = run(model_dir, chunked_prefill_size=chunk)
    assert out == ref
    assert engine.stats.cached_tokens >= 3 * 30  # siblings hit their group's prefix


def test_radix_off(moe):
    model_dir, ref = moe
    out, _ = run(model_dir, enable_radix_cache=False, chunked_prefill_size=16)
    assert out == ref


@pytest.mark.parametrize("overlap", [False, True])
def test_retraction(moe, overlap):
    model_dir, ref = moe
    out, engine = run(model_dir, kv_budget=200, new_token_ratio=0.05, overlap=overlap)
    assert engine.scheduler.num_retractions > 0
    assert out == ref
