"""Tokens are counted as they are generated, not when a row finishes: the engine's counters
(generated and admitted tokens, running / waiting requests, KV use) move step by step, and a
run's progress snapshots report them while no row is done yet."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_tiny_chat_model, write_config_dir  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.job.config import RunConfig  # noqa: E402
from batchrun.job.runner import Runner  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402
from batchrun.progress.server import ProgressHub, ProgressServer  # noqa: E402

MAX_NEW = 8


def test_engine_counts_tokens_step_by_step(tmp_path):
    model = str(write_config_dir("tiny", tmp_path))
    engine = Engine(EngineConfig(model=model, load_format="dummy", device="cpu", kv_budget=4096))
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    prompts = [[5 + i] * (10 + i) for i in range(3)]
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(str(i), ids, params))
    c = engine.counters
    assert (c.generated_tokens, c.admitted_tokens, c.num_waiting, c.num_running) == (0, 0, 3, 0)
    assert c.kv_total == engine.num_kv_slots > 0
    assert engine.step() == []
    c = engine.counters
    # the prefill step samples every request's first token; nothing has finished
    assert c.admitted_tokens == sum(map(len, prompts)) and c.admitted_cached_tokens == 0
    assert (c.generated_tokens, c.num_running, c.num_waiting) == (3, 3, 0)
    assert c.kv_used >= sum(map(len, prompts))
    for step in range(2, MAX_NEW):
        assert engine.step() == []
        assert engine.counters.generated_tokens == 3 * step  # before any request finished
    done = engine.step()
    assert len(done) == 3
    c = engine.counters
    assert c.generated_tokens == sum(r.completion_tokens for r in done) == 3 * MAX_NEW
    assert (c.num_running, c.kv_used) == (0, 0)  # what is left is evictable cache
    # the same prompt again: admitted from the prefix cache, counted as a hit
    engine.add_request(GenerateRequest("again", prompts[0], params))
    engine.step()
    c = engine.counters
    assert c.admitted_tokens == sum(map(len, prompts)) + len(prompts[0])
    assert c.admitted_cached_tokens == len(prompts[0]) - 1  # all but the last prompt token


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tinychat")
    make_tiny_chat_model(path)
    return str(path)


def test_a_run_reports_output_tokens_before_any_row_finishes(chat_model, tmp_path):
    rows = [{"id": f"r{i}", "prompt": f"Tell me about item {i}"} for i in range(4)]
    rows.append({"id": "bad"})  # no prompt: an error row
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    engine = Engine(EngineConfig(model=chat_model, device="cpu", kv_budget=4096))
    engine.generate([GenerateRequest("warm", [5, 6, 7], SamplingParams(max_new_tokens=3))])
    server = ProgressServer(ProgressHub(), "127.0.0.1", 0)  # ticked by hand, never started
    seen: list[tuple[int, int, float]] = []  # (rows ok, output tokens, recent tok/s) per step
    real_step = engine.step

    def step():
        server._tick()
        snap = server._snapshot
        seen.append((snap.rows_ok, snap.output_tokens, snap.recent_tok_s))
        return real_step()

    engine.step = step
    config = RunConfig(
        dataset=str(data),
        out=str(tmp_path / "out"),
        engine=engine.config,
        defaults=SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True),
        order="input",
        quiet=False,
        handle_signals=False,
    )
    runner = Runner(config, engine=engine, hub=server.hub)
    summary = runner.run()
    assert summary.status == "complete" and summary.session_tokens == 4 * 24
    before_rows = [(tokens, rate) for ok, tokens, rate in seen if ok == 0]
    # the four rows run together: 4 tokens a step, counted from the first step on
    assert max(tokens for tokens, _ in before_rows) >= 4 * 20, seen
    assert max(rate for _, rate in before_rows) > 0, seen
    server._tick()
    final = server._snapshot
    assert final.status == "complete" and final.rows_done == 5 and final.rows_failed == 1
    # this attempt's counts only (the engine generated 3 warm-up tokens before it)
    assert final.output_tokens == final.completion_tokens == summary.session_tokens
    assert final.input_tokens == summary.prompt_tokens
    assert [(e.row, e.id, e.type) for e in final.errors] == [(4, "bad", "invalid_request")]
    assert runner.progress.bar.n == 5  # the bar counts the error row too
