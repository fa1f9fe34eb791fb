"""Data parallel on the CPU: two engine processes give the same per-id outputs as one, prefix
groups stay on one engine, and load spreads over both."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_tiny_chat_model  # noqa: E402

from batchrun.cli import main  # noqa: E402
from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.engine_process.data_parallel import STICKY_PREFIX, DataParallelEngine  # noqa: E402
from batchrun.job.config import RunConfig  # noqa: E402
from batchrun.job.runner import Runner  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402
from batchrun.progress.hub import ProgressHub  # noqa: E402
from batchrun.progress.snapshot import SnapshotMaker  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tinychat")
    make_tiny_chat_model(path)
    return str(path)


def grouped_requests(groups: int, per_group: int) -> list[GenerateRequest]:
    params = SamplingParams(max_new_tokens=6, temperature=0)
    reqs = []
    for g in range(groups):
        prefix = [(7 * g + j) % 200 + 3 for j in range(STICKY_PREFIX + 8)]
        for q in range(per_group):
            reqs.append(GenerateRequest(f"g{g}q{q}", prefix + [q + 3, g + 3], params))
    return reqs


def test_dp2_equals_one_engine_and_keeps_groups_together(model):
    cfg = EngineConfig(model=model, device="cpu", kv_budget=4096, max_running=8)
    reqs = grouped_requests(groups=6, per_group=5)
    one = Engine(cfg)
    ref = {r.rid: r.output_ids for r in one.generate(reqs)}
    where: dict[str, int] = {}
    got = {}
    with DataParallelEngine(cfg, 2) as dp:
        assert dp.tokenizer is not None and dp.context_len > 0
        for r in reqs:
            before = list(dp.routed)
            dp.add_request(r)
            where[r.rid] = next(i for i in range(2) if dp.routed[i] != before[i])
        while dp.has_work:
            got.update({r.rid: r.output_ids for r in dp.step()})
        counters, per_engine = dp.counters, dp.counters_per_engine
    assert got == ref
    # the engines' counters sum to one engine's (each engine has a pool of its own)
    assert counters.generated_tokens == one.counters.generated_tokens == 30 * 6
    assert counters.admitted_tokens == one.counters.admitted_tokens
    assert counters.kv_total == 2 * one.counters.kv_total
    assert sum(c.generated_tokens for c in per_engine) == counters.generated_tokens
    assert all(c.generated_tokens > 0 and c.num_running == 0 for c in per_engine)
    assert all(n > 0 for n in dp.routed), dp.routed
    for g in range(6):  # slack 4 (max_running 8 / 2) > group size: a group never splits
        assert len({where[f"g{g}q{q}"] for q in range(5)}) == 1


def test_one_huge_group_spills_over():
    # routing alone, over stand-in engines: one prefix group larger than the slack
    dp = DataParallelEngine.__new__(DataParallelEngine)
    dp.engines = [SimpleNamespace(load=0, add_request=None) for _ in range(2)]
    dp.slack, dp._last, dp._last_engine, dp.routed = 4, None, 0, [0, 0]
    counts = [0, 0]
    for r in grouped_requests(groups=1, per_group=40):
        e = dp._route(r.input_ids)
        counts[e] += 1
        dp.engines[e].load += 1
        dp._last, dp._last_engine = r.input_ids, e
    assert min(counts) >= 15, counts  # both engines work on it


def test_cli_dp2_equals_dp1(model, tmp_path):
    ds = tmp_path / "in.jsonl"
    rows = [{"id": f"r{i}", "prompt": f"Question {i % 4}: tell me about {i}"} for i in range(30)]
    ds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    outs = []
    for dp in ("1", "2"):
        out = tmp_path / f"dp{dp}"
        argv = ["submit", str(ds), "--out", str(out), "--model", model, "--device", "cpu",
                "--max-tokens", "8", "--temperature", "0", "--kv-budget", "4096", "--quiet",
                "--dp", dp]  # fmt: skip
        r = CliRunner().invoke(main, argv)
        assert r.exit_code == 0, (r.output, r.exception)
        recs = [
            json.loads(x)
            for p in out.glob("results-*.jsonl")
            for x in p.read_text().split("\n")
            if x
        ]
        outs.append({r["id"]: r["text"] for r in recs})
    assert len(outs[0]) == 30 and outs[0] == outs[1]


def test_dp2_progress_counts_both_engines(model, tmp_path):
    ds = tmp_path / "in.jsonl"
    rows = [{"id": f"r{i}", "prompt": f"Question {i % 4}: tell me about {i}"} for i in range(16)]
    ds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = RunConfig(
        dataset=str(ds),
        out=str(tmp_path / "out"),
        engine=EngineConfig(model=model, device="cpu", kv_budget=4096),
        defaults=SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True),
        dp=2,
        quiet=True,
        handle_signals=False,
    )
    hub = ProgressHub()
    summary = Runner(config, hub=hub).run()
    state = hub.drain()
    assert summary.session_tokens == 16 * 8
    assert len(state.engines) == 2 and all(e.generated_tokens for e in state.engines)
    assert sum(e.generated_tokens for e in state.engines) == state.engine.generated_tokens
    assert state.engine.generated_tokens == summary.session_tokens
    lines = SnapshotMaker().make(state, clients=0).engines
    assert [(e.engine, e.running) for e in lines] == [(0, 0), (1, 0)]


def test_dp_bad_options_fail_fast(model, tmp_path):
    ds = tmp_path / "in.jsonl"
    ds.write_text('{"prompt": "hi"}\n')
    base = ["submit", str(ds), "--out", str(tmp_path / "o"), "--model", model, "--device", "cpu"]
    r = CliRunner().invoke(main, [*base, "--dp", "2", "--in-process"])
    assert r.exit_code == 2 and "--in-process" in r.output
