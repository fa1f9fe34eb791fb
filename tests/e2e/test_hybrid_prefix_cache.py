"""Prefix caching for hybrid models (engine/state_snapshots.py) on tiny Qwen3.5 / Qwen3-Next
checkpoints, fp32 on the CPU: a batch where rows share prefixes (a group, a group nested in it,
another group, a repeated prompt, rows that share nothing) gives the same greedy tokens with the
radix cache (hits start from a state snapshot) as without it (every row from position 0), with
chunked prefill on and off, dense and MoE, page size 1 and 4; retraction resumes from a
snapshot; and on a W2-like workload (one long shared system prompt) the run's cached tokens are
exactly what `batchrun plan` predicts at the snapshot boundaries."""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybrid_models import make_hybrid_model  # noqa: E402
from tiny_models import save_byte_tokenizer  # noqa: E402

from batchrun.cli import main  # noqa: E402
from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.job.order import order_items  # noqa: E402
from batchrun.job.plan import PrefixReuse  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

NEW_TOKENS = 8


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 256) for _ in range(n)]


def shared_prompts() -> list[list[int]]:
    rng = random.Random(7)
    sys_a, sys_b = _tokens(rng, 70), _tokens(rng, 45)
    nested = sys_a + _tokens(rng, 30)
    prompts = [sys_a + _tokens(rng, rng.randrange(2, 20)) for _ in range(5)]
    prompts += [nested + _tokens(rng, rng.randrange(1, 12)) for _ in range(3)]
    prompts += [sys_b + _tokens(rng, rng.randrange(3, 9)) for _ in range(3)]
    prompts += [prompts[0], _tokens(rng, 2), _tokens(rng, 33)]
    rng.shuffle(prompts)
    return prompts


PROMPTS = shared_prompts()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kind -> (checkpoint path, greedy tokens of PROMPTS without a prefix cache)."""
    made: dict = {}

    def get(kind: str):
        if kind not in made:
            path = tmp_path_factory.mktemp(kind)
            make_hybrid_model(kind, path)
            made[kind] = path, run(engine_of(path, enable_radix_cache=False))
        return made[kind]

    return get


def engine_of(path, **changes) -> Engine:
    fields = {"device": "cpu", "dtype": "float32", "kv_budget": 4096, "max_running": 6}
    return Engine(EngineConfig(model=str(path), **{**fields, **changes}))


def run(
    engine: Engine, prompts=PROMPTS, order: bool = True, new_tokens: int = NEW_TOKENS
) -> dict[str, list[int]]:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    if order:  # what `batchrun submit` feeds the engine (--order prefix)
        reqs = order_items(reqs, lambda r: r.input_ids)
    out = {}
    for res in engine.generate(reqs):
        assert res.finish_reason == "length", res
        out[res.rid] = res.output_ids
        engine.check_integrity()
    engine.check_integrity()
    assert engine.kv.cache.protected_size == 0
    return out


@pytest.mark.parametrize(
    ("kind", "changes"),
    [
        ("qwen3_5_text", {"chunked_prefill_size": 24}),
        ("qwen3_5_text", {"chunked_prefill_size": None}),
        ("qwen3_5_text", {"chunked_prefill_size": 24, "page_size": 4}),
        ("qwen3_5_moe_text", {"chunked_prefill_size": 24}),
        ("qwen3_next", {"chunked_prefill_size": None}),
    ],
)
def test_hits_give_the_tokens_of_misses(saved, kind, changes):
    path, misses = saved(kind)
    engine = engine_of(path, **changes)
    assert run(engine) == misses
    snaps = engine.kv.snapshots
    assert snaps is not None and snaps.num_loaded >= 8  # the groups' rows after the first
    assert engine.stats.cached_fraction > 0.5


def test_input_order_hits_fewer_with_the_same_tokens(saved):
    path, misses = saved("qwen3_5_text")
    engine = engine_of(path, chunked_prefill_size=24)
    assert run(engine, order=False) == misses


def test_retraction_resumes_from_a_snapshot(saved):
    path, _ = saved("qwen3_5_text")
    prompts = PROMPTS[:8]
    ref = run(engine_of(path, enable_radix_cache=False), prompts, new_tokens=24)
    engine = engine_of(path, kv_budget=200, new_token_ratio=0.05, chunked_prefill_size=24)
    assert run(engine, prompts, new_tokens=24) == ref
    assert engine.scheduler.num_retractions > 0
    # every retracted request's state at its computed length went into a snapshot
    assert engine.kv.snapshots.num_saved >= engine.scheduler.num_retractions


def test_no_radix_cache_no_snapshots(saved):
    path, _ = saved("qwen3_5_text")
    engine = engine_of(path, enable_radix_cache=False)
    assert engine.kv.snapshots is None and engine.runner.snapshots is None


def w2_prompts(rows: int = 40) -> list[list[int]]:
    """W2-like: most rows one long shared system prompt and a question, a few rows alone."""
    rng = random.Random(11)
    system = _tokens(rng, 160)
    prompts = [system + _tokens(rng, rng.randrange(8, 25)) for _ in range(rows)]
    prompts += [_tokens(rng, rng.randrange(20, 40)) for _ in range(4)]
    rng.shuffle(prompts)
    return prompts


def test_hit_rate_is_the_prediction(saved):
    path, _ = saved("qwen3_5_text")
    prompts = w2_prompts()
    reuse = PrefixReuse(None, "prefix", hybrid=True)
    for p in prompts:
        reuse.add(p, NEW_TOKENS)
    reuse.flush()
    engine = engine_of(path, max_running=8)
    run(engine, prompts)
    stats = engine.stats
    assert stats.prompt_tokens == reuse.prompt_tokens
    assert stats.cached_tokens == reuse.unlimited
    assert stats.cached_fraction > 0.75


def test_cli_plan_predicts_the_submitted_hit_rate(saved, tmp_path):
    path, _ = saved("qwen3_5_text")
    save_byte_tokenizer(path)
    ds = tmp_path / "w2.jsonl"
    rows = [{"id": f"r{i}", "prompt_token_ids": p} for i, p in enumerate(w2_prompts())]
    ds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--model", str(path), "--max-tokens", str(NEW_TOKENS)]
    plan = CliRunner().invoke(main, ["plan", str(ds), *common, "--device", "cpu"])
    assert plan.exit_code == 0, plan.output
    assert "state-snapshot boundaries" in plan.output and "snapshots " in plan.output
    pattern = r"unlimited cache: [0-9.]+ of prompt tokens \(([0-9,]+) of ([0-9,]+)"
    m = re.search(pattern, plan.output)
    predicted, total = (int(g.replace(",", "")) for g in m.groups())
    out = tmp_path / "run"
    args = ["submit", str(ds), "--out", str(out), *common, "--device", "cpu", "--quiet"]
    r = CliRunner().invoke(main, [*args, "--temperature", "0", "--max-running", "8"])
    assert r.exit_code == 0, (r.output, r.exception)
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert (counts["cached_tokens"], counts["prompt_tokens"]) == (predicted, total)
