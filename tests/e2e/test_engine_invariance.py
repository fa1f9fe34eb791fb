"""Greedy outputs do not depend on how the engine schedules: radix cache on/off, chunked-prefill
size, concurrency, page size, or a KV pool so small that requests get retracted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_tiny_model  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

NEW = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama", path)
    return str(path)


def workload() -> list[GenerateRequest]:
    """24 prompts in 4 groups sharing a 40-token prefix, plus 8 unrelated ones."""
    g = torch.Generator().manual_seed(7)
    reqs = []
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    for grp in range(4):
        prefix = torch.randint(3, 256, (40,), generator=g).tolist()
        for q in range(6):
            tail = torch.randint(
                3, 256, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g
            ).tolist()
            reqs.append(GenerateRequest(f"g{grp}q{q}", prefix + tail, params))
    for i in range(8):
        n = int(torch.randint(5, 70, (1,), generator=g))
        reqs.append(
            GenerateRequest(f"u{i}", torch.randint(3, 256, (n,), generator=g).tolist(), params)
        )
    # interleave so that siblings are not adjacent
    return reqs[::2] + reqs[1::2]


def run(model_dir: str, **overrides) -> tuple[dict[str, list[int]], Engine]:
    cfg = EngineConfig(model=model_dir, device="cpu", dtype="float32", kv_budget=8192)
    engine = Engine(EngineConfig(**{**cfg.__dict__, **overrides}))
    out = {}
    for res in engine.generate(workload()):
        assert res.finish_reason == "length", res
        out[res.rid] = res.output_ids
        engine.check_integrity()
    engine.check_integrity()
    assert not engine.has_work
    return out, engine


@pytest.fixture(scope="module")
def reference(model_dir):
    out, engine = run(model_dir, enable_radix_cache=False, max_running=1, chunked_prefill_size=None)
    assert engine.stats.cached_tokens == 0
    return out


def test_radix_cache_on_gives_same_tokens_and_hits(model_dir, reference):
    out, engine = run(model_dir)
    assert out == reference
    # every group's siblings hit the shared 40-token prefix
    assert engine.stats.cached_tokens >= 4 * 5 * 40
    assert engine.scheduler.num_held > 0  # siblings waited for the prefix to be computed once


@pytest.mark.parametrize("chunk", [16, 64, None])
def test_chunked_prefill_sizes(model_dir, reference, chunk):
    out, _ = run(model_dir, chunked_prefill_size=chunk)
    assert out == reference


@pytest.mark.parametrize("max_running", [1, 64])
def test_concurrency(model_dir, reference, max_running):
    out, _ = run(model_dir, max_running=max_running)
    assert out == reference


def test_page_size_4(model_dir, reference):
    out, engine = run(model_dir, page_size=4, chunked_prefill_size=16)
    assert out == reference
    assert engine.stats.cached_tokens > 0


@pytest.mark.parametrize("radix", [True, False])
def test_retraction_keeps_greedy_output(model_dir, reference, radix):
    # 300 slots for 32 requests of up to ~100 tokens: decodes run out and requests get retracted
    out, engine = run(model_dir, kv_budget=300, enable_radix_cache=radix, new_token_ratio=0.05)
    assert engine.scheduler.num_retractions > 0
    assert out == reference


def test_n_samples_share_the_prompt(model_dir):
    cfg = EngineConfig(model=model_dir, device="cpu", dtype="float32", kv_budget=8192)
    engine = Engine(cfg)
    prompt = list(range(10, 90))
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=4, seed=3)
    results = list(engine.generate([GenerateRequest("a", prompt, params)]))
    assert sorted(r.index for r in results) == [0, 1, 2, 3]
    assert sum(r.cached_tokens for r in results) >= 3 * 79  # three samples reuse the prompt KV
    assert len({tuple(r.output_ids) for r in results}) > 1  # different seeds, different samples
    engine.check_integrity()


@pytest.mark.parametrize("kv_budget", [8192, 300])
def test_overlap_scheduling_gives_same_tokens(model_dir, reference, kv_budget):
    # on the CPU every op is synchronous, but the overlapped loop's bookkeeping (placeholders,
    # tokens fed from the device token pool, wasted decodes after a finish, sync before a
    # retraction) runs exactly as on CUDA
    out, engine = run(model_dir, overlap=True, kv_budget=kv_budget, new_token_ratio=0.05)
    assert out == reference
    if kv_budget == 300:
        assert engine.scheduler.num_retractions > 0


def test_overlap_with_eos_and_stop_ids(model_dir):
    cfg = EngineConfig(model=model_dir, device="cpu", dtype="float32", kv_budget=8192)
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [list(range(5 + i, 30 + i)) for i in range(6)]
    ref = {
        r.rid: r.output_ids
        for r in Engine(cfg).generate(
            GenerateRequest(str(i), p, greedy) for i, p in enumerate(prompts)
        )
    }
    # stop each request on the token greedy produces at step 3 + i
    reqs = [
        GenerateRequest(
            str(i),
            p,
            SamplingParams(
                max_new_tokens=24, temperature=0.0, stop_token_ids=(ref[str(i)][3 + i],)
            ),
        )
        for i, p in enumerate(prompts)
    ]
    for overlap in (False, True):
        engine = Engine(EngineConfig(**{**cfg.__dict__, "overlap": overlap}))
        got = {r.rid: r for r in engine.generate(reqs)}
        for i in range(6):
            want = ref[str(i)]
            stop_at = want.index(want[3 + i])
            assert got[str(i)].output_ids == want[: stop_at + 1]
            assert got[str(i)].finish_reason == "stop"
        engine.check_integrity()
        assert not engine.has_work


def test_deferred_request_table_writes(model_dir, reference):
    # on CUDA the request-to-token writes are queued and applied by the next launch in one
    # scatter; force that path on the CPU
    cfg = EngineConfig(
        model=model_dir,
        device="cpu",
        dtype="float32",
        kv_budget=300,
        overlap=True,
        new_token_ratio=0.05,
    )
    engine = Engine(cfg)
    engine.runner.req_pool._deferred = True
    out = {r.rid: r.output_ids for r in engine.generate(workload())}
    assert out == reference
    engine.check_integrity()
