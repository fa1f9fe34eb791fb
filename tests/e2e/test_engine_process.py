"""The engine in its own process: same outputs as in-process, batched notifications,
a graceful drop, and a clear error with a consistent out directory when the process is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slow_engine import slow_engine  # noqa: E402
from spies import count_calls  # noqa: E402
from tiny_models import make_tiny_chat_model  # noqa: E402

from batchrun.cli import main  # noqa: E402
from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.engine_process.client import EngineProcess  # noqa: E402
from batchrun.errors import ModelError  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tinychat")
    make_tiny_chat_model(path)
    return str(path)


def dataset(path: Path, rows: int) -> Path:
    lines = [
        json.dumps({"id": f"r{i}", "prompt": f"Tell me about {i % 5}, item {i}"})
        for i in range(rows)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def cli_args(model: str, ds: Path, out: Path, *extra: str) -> list[str]:
    return [
        "submit", str(ds), "--out", str(out), "--model", model, "--device", "cpu",
        "--max-tokens", "10", "--temperature", "0", "--kv-budget", "4096", "--quiet", *extra,
    ]  # fmt: skip


def results(out: Path) -> dict[str, tuple]:
    recs = [
        json.loads(x)
        for p in sorted(out.glob("results-*.jsonl"))
        for x in p.read_text().splitlines()
    ]
    return {r["id"]: (r["text"], r.get("token_ids"), r["finish_reason"]) for r in recs}


def test_engine_process_equals_in_process(model, tmp_path):
    ds = dataset(tmp_path / "in.jsonl", 40)
    outs = {}
    for mode in ("--engine-process", "--in-process"):
        out = tmp_path / mode.strip("-")
        r = CliRunner().invoke(
            main, cli_args(model, ds, out, mode, "--token-ids", "--notify-batch", "4")
        )
        assert r.exit_code == 0, (r.output, r.exception)
        outs[mode] = results(out)
    assert len(outs["--engine-process"]) == 40
    assert outs["--engine-process"] == outs["--in-process"]


def test_client_api_matches_engine_and_drops_waiting(model):
    cfg = EngineConfig(model=model, device="cpu", kv_budget=4096, max_running=4)
    reqs = [
        GenerateRequest(
            str(i),
            [10 + i, 20, 30, 40 + i],
            SamplingParams(max_new_tokens=6, temperature=0, n=1 + i % 2),
        )
        for i in range(12)
    ]
    ref = {(r.rid, r.index): r.output_ids for r in Engine(cfg).generate(reqs)}
    with EngineProcess(cfg, notify_batch=3) as ep:
        assert ep.context_len > 0 and ep.tokenizer is not None
        for r in reqs:
            ep.add_request(r)
        got = {}
        while ep.has_work:
            for r in ep.step():
                got[(r.rid, r.index)] = r.output_ids
        assert got == ref
        # a graceful stop: what has not started is dropped, what runs finishes, nothing hangs
        for r in reqs:
            ep.add_request(r)
        ep.step()  # sent; the engine starts up to max_running of them
        ep.drop_waiting()
        deadline = time.monotonic() + 60
        while ep.has_work:
            ep.step()
            assert time.monotonic() < deadline, "has_work never cleared after drop_waiting"


def test_counters_arrive_while_no_row_has_finished(model):
    """Each step takes 50 ms (slow_engine) and the rows need 40 of them: the counters come
    about every 0.5 s meanwhile, in Results messages without results, not one per step."""
    cfg = EngineConfig(model=model, device="cpu", kv_budget=4096)
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    with EngineProcess(cfg, notify_batch=64, engine_factory=slow_engine) as ep:
        messages = count_calls(pytest.MonkeyPatch(), ep, "_handle")
        for i in range(2):
            ep.add_request(GenerateRequest(str(i), [10 + i, 20, 30], params))
        seen, done = [], []
        start = time.monotonic()
        while ep.has_work:
            done += ep.step()
            seen.append((len(done), ep.counters))
        elapsed = time.monotonic() - start
        final = ep.counters
    before = [c for n, c in seen if n == 0]
    assert max(c.generated_tokens for c in before) >= 2 * 10, before
    assert any(c.num_running == 2 and c.kv_used > 0 for c in before), before
    assert final.generated_tokens == sum(r.completion_tokens for r in done) == 80
    assert final.num_running == 0 and final.admitted_tokens == 6
    # one message per 0.5 s at most (and the last), however many steps ran meanwhile
    assert 3 <= messages["n"] <= elapsed / 0.5 + 2, (messages, elapsed)


def test_refused_request_comes_back_as_an_error(model):
    cfg = EngineConfig(model=model, device="cpu", kv_budget=4096)
    with EngineProcess(cfg) as ep:
        too_long = GenerateRequest(
            "x", [5] * (ep.context_len + 1), SamplingParams(max_new_tokens=2)
        )
        ep.add_request(too_long)
        ep.add_request(
            GenerateRequest("ok", [5, 6, 7], SamplingParams(max_new_tokens=2, temperature=0))
        )
        got = {}
        while ep.has_work:
            got.update({r.rid: r for r in ep.step()})
        assert got["x"].finish_reason == "abort" and "context length" in got["x"].error
        assert got["ok"].finish_reason == "length"


def test_input_ids_are_checked_before_they_are_sent(model):
    """A request the engine process could not even decode (ids that are not ints) is refused
    by add_request with the engine's message; the engine process goes on."""
    from transformers import BatchEncoding

    cfg = EngineConfig(model=model, device="cpu", kv_budget=4096)
    with EngineProcess(cfg) as ep:
        for bad, fragment in (
            (BatchEncoding({"input_ids": [5, 6], "attention_mask": [1, 1]}), "BatchEncoding"),
            ([5, "6"], "input_ids[1] is '6' (str)"),
            ([5, ep.vocab_size], f"input_ids[1] is {ep.vocab_size}"),
        ):
            with pytest.raises(ValueError, match="request 'bad': input_ids must be") as info:
                ep.add_request(GenerateRequest("bad", bad, SamplingParams(max_new_tokens=2)))
            assert fragment in str(info.value)
        assert not ep.has_work
        ep.add_request(
            GenerateRequest("ok", [5, 6, 7], SamplingParams(max_new_tokens=2, temperature=0))
        )
        got = []
        while ep.has_work:
            got += ep.step()
        assert [(r.rid, r.finish_reason) for r in got] == [("ok", "length")]


def test_model_that_cannot_load_is_a_model_error(tmp_path):
    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelError):
        EngineProcess(EngineConfig(model=str(bad), device="cpu"))


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def engine_pid(pid: int) -> int | None:
    for child in children(pid):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in cmd:
            return child
    return None


def manifest(out: Path) -> dict | None:
    try:
        return json.loads((out / "manifest.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def test_killing_the_engine_process_is_a_clear_error_and_resumable(model, tmp_path):
    ds = dataset(tmp_path / "in.jsonl", 150)
    out = tmp_path / "out"
    # one row at a time: the run takes ~6 s on two cores (at full width, 0.2 s: it could end
    # before the kill)
    argv = cli_args(model, ds, out, "--commit-every", "2", "--notify-batch", "2")
    argv += ["--max-tokens", "64", "--ignore-eos", "--max-running", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchrun.cli", *argv],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            m = manifest(out)
            if m is not None and m.get("ledger_rows", 0) >= 4:
                break
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.01)
        pid = engine_pid(proc.pid)
        assert pid is not None, "no engine process found"
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert "engine process" in err and "killed by signal 9" in err and "resume" in err
    assert "Traceback" not in err
    m = manifest(out)
    assert m["status"] == "failed" and 4 <= m["ledger_rows"] < 150
    # consistent: resume completes and every id is there exactly once
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0, (r.output, r.exception)
    got = results(out)
    assert len(got) == 150 and manifest(out)["status"] == "complete"
    lines = sum(len(p.read_text().splitlines()) for p in out.glob("results-*.jsonl"))
    assert lines == 150
