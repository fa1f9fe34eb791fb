"""Hybrid prefix caching on the GPU (engine/state_snapshots.py) with overlap on: the snapshot
copies run on the step's stream in the order the scheduler calls them (saved after the launch
that computes a boundary, loaded at admission before the row's first step), so rows that start
from a snapshot give the greedy tokens of a run without the prefix cache (fp32), and the run's
cached tokens are the prefix order's prediction."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from batchrun.config import EngineConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NEW = 16


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    system = [rng.randrange(3, 256) for _ in range(300)]
    nested = system + [rng.randrange(3, 256) for _ in range(90)]
    prompts = [system + [rng.randrange(3, 256) for _ in range(rng.randrange(5, 60))]]
    prompts += [system + [rng.randrange(3, 256) for _ in range(rng.randrange(5, 60))]
                for _ in range(40)]  # fmt: skip
    prompts += [nested + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 20))]
                for _ in range(12)]  # fmt: skip
    prompts += [[rng.randrange(3, 256) for _ in range(rng.randrange(2, 200))] for _ in range(8)]
    rng.shuffle(prompts)
    return prompts


def _run(path, prompts, **changes):
    from batchrun.engine.engine import Engine
    from batchrun.job.order import order_items
    from batchrun.params import GenerateRequest, SamplingParams

    fields = dict(device="cuda", dtype="float32", kv_budget=16384, chunked_prefill_size=256,
                  max_running=16)  # fmt: skip
    engine = Engine(EngineConfig(model=str(path), **{**fields, **changes}))
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    reqs = order_items(reqs, lambda r: r.input_ids)
    got = {r.rid: r.output_ids for r in engine.generate(reqs)}
    engine.check_integrity()
    return got, engine


@pytest.mark.parametrize("kind", ["qwen3_5_text", "qwen3_next"])
def test_hybrid_prefix_hits_equal_misses_with_overlap(kind, tmp_path):
    from hybrid_models import make_hybrid_model

    from batchrun.job.plan import PrefixReuse

    make_hybrid_model(kind, tmp_path)
    prompts = _prompts()
    misses, _ = _run(tmp_path, prompts, enable_radix_cache=False)
    hits, engine = _run(tmp_path, prompts)
    assert engine.overlap and engine.kv.snapshots is not None
    assert hits == misses
    reuse = PrefixReuse(None, "prefix", hybrid=True)
    for p in prompts:
        reuse.add(p, NEW)
    reuse.flush()
    assert engine.stats.cached_tokens == reuse.unlimited
    assert engine.stats.cached_fraction > 0.6
