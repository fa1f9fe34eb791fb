"""Prefix-aware ordering end to end: a shuffled shared-prefix dataset on a tiny model with a KV
budget far smaller than all prefixes together. Prefix order reaches the ideal cached fraction,
input order falls far short, and greedy outputs per id are the same either way."""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_tiny_chat_model, make_tiny_model  # noqa: E402

from batchrun.cli import main  # noqa: E402
from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.job.order import order_items, reuse_lens, sort_key  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

GROUPS, PER_GROUP, PREFIX = 24, 6, 128
BUDGET = 400  # KV tokens; the distinct prefixes alone are 24 * 128 = 3072


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama", path)
    return str(path)


def shared_prefix_requests() -> list[GenerateRequest]:
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    reqs = []
    for g in range(GROUPS):
        prefix = [rng.randrange(3, 256) for _ in range(PREFIX)]
        for q in range(PER_GROUP):
            tail = [rng.randrange(3, 256) for _ in range(rng.randrange(4, 13))]
            reqs.append(GenerateRequest(f"g{g}q{q}", prefix + tail, params))
    rng.shuffle(reqs)
    return reqs


def ideal_fraction(prompts: list[list[int]]) -> float:
    keys = sorted(sort_key(p) for p in prompts)
    return float(reuse_lens(keys).sum()) / sum(len(p) for p in prompts)


def run(model_dir: str, reqs: list[GenerateRequest]) -> tuple[dict[str, list[int]], Engine]:
    cfg = EngineConfig(model=model_dir, device="cpu", dtype="float32", kv_budget=BUDGET)
    engine = Engine(EngineConfig(**{**cfg.__dict__, "max_running": 8}))
    out = {}
    for res in engine.generate(reqs):
        assert res.finish_reason == "length", res
        out[res.rid] = res.output_ids
        engine.check_integrity()
        if engine.scheduler._pins:
            assert engine.scheduler.waiting  # a pin never outlives the queue
    engine.check_integrity()
    assert not engine.has_work
    assert engine.kv.cache.protected_size == 0  # every lock (requests' and pins') released
    return out, engine


def test_prefix_order_reaches_the_ideal_cached_fraction(model_dir) -> None:
    reqs = shared_prefix_requests()
    ideal = ideal_fraction([r.input_ids for r in reqs])
    assert ideal > 0.75
    by_prefix, e_prefix = run(model_dir, order_items(reqs, lambda r: r.input_ids))
    by_input, e_input = run(model_dir, reqs)
    prefix, inp = e_prefix.stats.cached_fraction, e_input.stats.cached_fraction
    print(f"ideal {ideal:.3f}, prefix order {prefix:.3f}, input order {inp:.3f}")
    assert prefix >= 0.9 * ideal
    assert inp <= 0.7 * prefix  # the print above (pytest -s): 0.785 vs 0.412
    assert by_prefix == by_input  # greedy, per id: the order changes nothing but speed


def chat_rows() -> list[dict]:
    """Documents queried several times: prompt = document + question, shuffled."""
    rng = random.Random(1)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "zeta"]
    rows = []
    for d in range(32):
        doc = " ".join(rng.choice(words) for _ in range(24))
        for q in range(4):
            rows.append({"id": f"d{d}q{q}", "prompt": f"{doc}\nQ{q}: which word is {q}?"})
    rng.shuffle(rows)
    return rows


def test_cli_order_prefix_vs_input(tmp_path) -> None:
    model = tmp_path / "chat"
    make_tiny_chat_model(model)
    ds = tmp_path / "docs.jsonl"
    ds.write_text("".join(json.dumps(r) + "\n" for r in chat_rows()))
    common = ["--model", str(model), "--kv-budget", "400"]
    plan = CliRunner().invoke(main, ["plan", str(ds), *common, "--max-tokens", "6"])
    assert plan.exit_code == 0, plan.output
    ideal = float(re.search(r"unlimited cache: ([0-9.]+)", plan.output).group(1))
    predicted = float(re.search(r"--order prefix: ~([0-9.]+) predicted", plan.output).group(1))
    assert ideal > 0.6 and predicted > 0.8 * ideal

    fractions, texts = {}, {}
    for order in ("prefix", "input"):
        out = tmp_path / order
        args = ["submit", str(ds), "--out", str(out), *common, "--device", "cpu"]
        args += ["--max-tokens", "6", "--temperature", "0", "--max-running", "8", "--quiet"]
        r = CliRunner().invoke(main, [*args, "--order", order])
        assert r.exit_code == 0, (r.output, r.exception)
        assert "cached_fraction" in r.output
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["config"]["order"] == order
        c = manifest["counts"]
        assert c["rows_ok"] == 128
        fractions[order] = c["cached_tokens"] / c["prompt_tokens"]
        records = [
            json.loads(line) for p in out.glob("results-*.jsonl") for line in p.read_text().split()
        ]
        assert sum(rec["usage"]["cached_tokens"] for rec in records) == c["cached_tokens"]
        texts[order] = {rec["id"]: rec["text"] for rec in records}
    print(f"ideal {ideal:.3f}, prefix {fractions['prefix']:.3f}, input {fractions['input']:.3f}")
    assert fractions["prefix"] >= 0.9 * ideal
    assert fractions["input"] <= 0.7 * fractions["prefix"]
    assert texts["prefix"] == texts["input"]

    plan_input = CliRunner().invoke(main, ["plan", str(ds), *common, "--order", "input"])
    predicted_input = float(re.search(r"--order input: ~([0-9.]+)", plan_input.output).group(1))
    assert predicted_input < predicted
