"""Crash-safe resume, signals, sharding and merge, end to end on the tiny chat model (CPU).

Subprocess runs (``python -m batchrun.cli submit``) are killed with SIGKILL at random moments,
interrupted with SIGTERM, or stopped twice; in-process runs (click's CliRunner) cover the rest.
Every scenario ends with every input row exactly once and the same text as an uninterrupted
greedy run."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_tiny_chat_model  # noqa: E402

from batchrun.cli import main  # noqa: E402

NUM_ROWS = 60
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tinychat")
    make_tiny_chat_model(path)
    return str(path)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "in.jsonl"
    lines = []
    for i in range(NUM_ROWS):
        if i % 17 == 16:
            lines.append("{not json")  # bad rows: errors, also exactly once
        elif i % 3 == 0:
            msgs = [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"q{i}"},
            ]
            lines.append(json.dumps({"id": f"r{i}", "messages": msgs}))
        else:
            lines.append(json.dumps({"id": f"r{i}", "prompt": f"Tell me about topic {i % 7}, {i}"}))
    path.write_text("\n".join(lines) + "\n")
    return path


def args(model: str, dataset: Path, out: Path, *extra: str) -> list[str]:
    return [
        "submit",
        str(dataset),
        "--out",
        str(out),
        "--model",
        model,
        "--device",
        "cpu",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--kv-budget",
        "4096",
        "--commit-every",
        "3",
        "--quiet",
        *extra,
    ]


def invoke(argv: list[str], code: int = 0):
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == code, (result.output, result.exception)
    assert "Traceback" not in result.output
    return result


def spawn(argv: list[str], stdin: Path | None = None) -> subprocess.Popen:
    # one thread: a tiny model gains nothing from more, and it keeps the child from fighting
    # the test process (or a parallel test run) for the CPU
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with open(stdin or os.devnull, "rb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "batchrun.cli", *argv],
            env=env,
            stdin=f,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


def manifest(out: Path) -> dict | None:
    try:
        return json.loads((out / "manifest.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def wait_for(proc: subprocess.Popen, out: Path, rows: int, timeout: float = 60.0) -> bool:
    """Wait until the run committed at least `rows` rows (False if the process ended first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = manifest(out)
        if m is not None and m.get("ledger_rows", 0) >= rows and m["status"] == "running":
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.003)
    raise AssertionError(f"no progress to {rows} rows in {timeout} s")


def committed(out: Path) -> tuple[dict, list[dict]]:
    """(id -> output, errors) of what the manifest commits; asserts every line is whole."""
    m = manifest(out)
    results, errors = {}, []
    for f in m["files"]:
        data = (out / f["path"]).read_bytes()[: f["bytes"]]
        recs = [json.loads(x) for x in data.splitlines()]
        assert len(recs) == f["rows"]
        if f["path"].startswith("results-"):
            for r in recs:
                assert r["id"] not in results, f"{r['id']} committed twice"
                results[r["id"]] = (r["text"], r["finish_reason"], r["usage"]["completion_tokens"])
        else:
            errors += recs
    assert len(results) + len(errors) == m["ledger_rows"]
    return results, errors


@pytest.fixture(scope="module")
def baseline(model, dataset, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("base") / "o"
    invoke(args(model, dataset, out))
    results, errors = committed(out)
    assert len(results) + len(errors) == NUM_ROWS and len(errors) == 3
    return results


def check_complete(out: Path, baseline: dict) -> None:
    m = manifest(out)
    assert m["status"] == "complete" and m["counts"]["rows_total"] == NUM_ROWS
    results, errors = committed(out)
    assert results == baseline
    assert sorted(e["row"] for e in errors) == [16, 33, 50]
    assert not any(p.name.endswith(".tmp") for p in out.iterdir())


@pytest.mark.slow
def test_kill9_at_random_moments_then_resume(model, dataset, baseline, tmp_path):
    """SIGKILL at 10 random moments: twice during start-up, then 8 times at random points of the
    run (once the attempt has committed 1-6 more rows, plus 0-40 ms, so the kill lands anywhere
    between or inside commits). Each attempt resumes the last; the end result equals the
    baseline, and after every kill the committed part is valid."""
    rng = random.Random(int(os.environ.get("BATCHRUN_TEST_SEED", "7")))
    out = tmp_path / "o"
    # one row at a time, each reported as it finishes: rows finish (and commits happen) all
    # through the run
    argv = args(model, dataset, out, "--max-running", "1", "--notify-batch", "1")
    kills = 0
    for i in range(10):
        before = (manifest(out) or {}).get("ledger_rows", 0)
        proc = spawn(argv)
        if i < 2:
            time.sleep(rng.uniform(0.3, 2.5))
        else:
            assert wait_for(proc, out, before + rng.randint(1, 6)), proc.communicate()
            time.sleep(rng.uniform(0, 0.04))
        if proc.poll() is None:
            proc.kill()
            kills += 1
        proc.communicate(timeout=60)
        if manifest(out) is not None:
            committed(out)  # the committed part is valid at every instant
    assert kills == 10
    assert manifest(out)["status"] != "complete"
    result = invoke(argv)
    assert "resuming" in result.output
    check_complete(out, baseline)


def test_sigterm_drains_commits_and_exits_5(model, dataset, baseline, tmp_path):
    out = tmp_path / "o"
    argv = args(model, dataset, out, "--max-running", "2")
    proc = spawn(argv)
    assert wait_for(proc, out, 6)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 5, err
    assert "interrupted; resumable: run the same command again" in err
    m = manifest(out)
    assert m["status"] == "interrupted" and 6 <= m["ledger_rows"] < NUM_ROWS
    for f in m["files"]:  # a drained stop leaves no uncommitted tail
        assert (out / f["path"]).stat().st_size == f["bytes"]
    invoke(argv)
    check_complete(out, baseline)


def test_second_signal_exits_at_once(model, dataset, baseline, tmp_path):
    out = tmp_path / "o"
    # many long rows in flight, so the drain after the first signal (all of them, 48k tokens) is
    # still going when the second comes, however fast the machine
    argv = args(model, dataset, out, "--max-running", "64", "--drain-timeout", "600")
    argv[argv.index("--max-tokens") + 1] = "800"
    argv += ["--ignore-eos"]
    proc = spawn(argv)
    assert wait_for(proc, out, 0)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 5, err
    assert "again: exiting now" in err
    assert manifest(out)["status"] == "running"  # no final commit: exited mid-drain
    committed(out)


def test_fingerprint_mismatch_refused_and_complete_run_is_a_noop(model, dataset, tmp_path):
    out = tmp_path / "o"
    invoke(args(model, dataset, out, "--limit", "9"))
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    r = invoke(args(model, dataset, out, "--limit", "9"))
    assert "already complete" in r.output
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    for extra in (["--max-tokens", "9"], ["--order", "input"], ["--prompt-column", "q"]):
        r = invoke(args(model, dataset, out, "--limit", "9", *extra), code=1)
        assert "different run" in r.output and "--overwrite" in r.output
    r = invoke(args(model, dataset, out, "--limit", "10"), code=1)
    assert "--limit" in r.output
    invoke(args(model, dataset, out, "--limit", "9", "--max-tokens", "9", "--overwrite"))
    assert manifest(out)["config"]["defaults"]["max_new_tokens"] == 9


@pytest.mark.parametrize("fail", [("fsync", 9), ("write", 4)])
def test_write_error_stops_cleanly_and_resume_completes(
    model, dataset, baseline, tmp_path, monkeypatch, fail
):
    name, after = fail
    real = getattr(os, name)
    calls = {"n": 0}

    def broken(*a):
        calls["n"] += 1
        if calls["n"] > after:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*a)

    out = tmp_path / "o"
    monkeypatch.setattr(os, name, broken)
    # two rows at a time, reported as they finish: commits (and fsyncs) all through the run
    r = invoke(args(model, dataset, out, "--max-running", "2", "--notify-batch", "1"), code=1)
    monkeypatch.undo()
    assert "No space left on device" in r.output and "run the same command again" in r.output
    m = manifest(out)
    assert m["status"] == "running" and m["ledger_rows"] < NUM_ROWS
    results, errors = committed(out)
    assert {k: baseline[k] for k in results} == results  # what was committed is right
    invoke(args(model, dataset, out))
    check_complete(out, baseline)


def read_merged(out: Path) -> dict:
    results = {}
    for p in sorted(out.glob("results-*.jsonl")):
        for line in p.read_text().splitlines():
            r = json.loads(line)
            assert r["id"] not in results
            results[r["id"]] = (r["text"], r["finish_reason"], r["usage"]["completion_tokens"])
    return results


def test_two_shards_and_merge(model, dataset, baseline, tmp_path, monkeypatch):
    out = tmp_path / "o"
    # shard 0 from a Slurm array task's environment (--array=3-4: task 3 is index 0)
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "3")
    invoke(args(model, dataset, out))
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID")
    assert (out / "shard-0" / "manifest.json").exists() and not (out / "manifest.json").exists()
    # shard 1 missing: merge reports it and every id it would hold
    r = invoke(["merge", str(out)], code=1)
    assert "shard-1: missing" in r.output and "not merged" in r.output
    n0 = manifest(out / "shard-0")["ledger_rows"]
    assert 0 < n0 < NUM_ROWS and f"{NUM_ROWS - n0} missing" in r.output
    invoke(args(model, dataset, out, "--num-shards", "2", "--shard-index", "1"))
    r = invoke(["merge", str(out)])
    assert "0 missing, 0 duplicate" in r.output
    merged = out / "merged"
    assert read_merged(merged) == baseline
    assert len(list(merged.glob("errors-*.jsonl"))) >= 1
    r = invoke(["inspect", str(merged)])
    assert "complete" in r.output and "check        ok" in r.output
    # a missing and a duplicate row: shard-0's last ledger entry replaced by one of shard-1's
    ledger0, ledger1 = (out / f"shard-{i}" / "rows-committed.bin" for i in (0, 1))
    lost = int.from_bytes(ledger0.read_bytes()[-8:], "little")
    dup = int.from_bytes(ledger1.read_bytes()[:8], "little")
    ledger0.write_bytes(ledger0.read_bytes()[:-8] + dup.to_bytes(8, "little"))
    r = invoke(["merge", str(out)], code=1)
    assert "1 missing, 1 duplicate" in r.output
    ids = {int(json.loads(x)["row"]): json.loads(x)["id"] for x in read_lines(dataset)}
    assert f"missing      id '{ids.get(lost, str(lost))}' (row {lost})" in r.output
    assert f"id '{ids.get(dup, str(dup))}' (row {dup}) in shard-0, shard-1" in r.output


def read_lines(dataset: Path) -> list[str]:
    out = []
    for i, line in enumerate(dataset.read_text().splitlines()):
        try:
            out.append(json.dumps({**json.loads(line), "row": i}))
        except json.JSONDecodeError:
            pass
    return out


DUP_REPEATS = {10: 3, 20: 7, 25: 3, 33: 12}  # row -> the earlier row whose id it repeats


@pytest.fixture(scope="module")
def dup_dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dup") / "in.jsonl"
    lines = []
    for i in range(40):
        row_id = f"r{DUP_REPEATS.get(i, i)}"
        line = {"id": row_id, "prompt": f"Tell me about topic {i % 7}, {i}"}
        lines.append("{not json" if i == 16 else json.dumps(line))
    path.write_text("\n".join(lines) + "\n")
    return path


def check_duplicate_errors(results: dict, errors: list[dict]) -> None:
    assert len(results) + len(errors) == 40 and len({e["row"] for e in errors}) == len(errors)
    repeats = {e["row"]: e for e in errors if e["error"]["type"] == "duplicate_id"}
    assert sorted(repeats) == sorted(DUP_REPEATS)
    for row, first in DUP_REPEATS.items():
        assert f"id 'r{first}' repeats row {first} " in repeats[row]["error"]["message"]


def test_duplicate_ids_through_resume_and_shards(model, dup_dataset, tmp_path, monkeypatch):
    out = tmp_path / "o"
    real, calls = os.fsync, {"n": 0}

    def broken(fd):
        calls["n"] += 1
        if calls["n"] > 9:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    # a first attempt that stops on a write error part way, then the resume: the resumed pass
    # finds the same repeats again and writes none of the committed ones twice
    monkeypatch.setattr(os, "fsync", broken)
    invoke(args(model, dup_dataset, out, "--max-running", "2", "--notify-batch", "1"), code=1)
    monkeypatch.undo()
    assert 0 < manifest(out)["ledger_rows"] < 40
    invoke(args(model, dup_dataset, out))
    assert manifest(out)["status"] == "complete"
    results, errors = committed(out)
    check_duplicate_errors(results, errors)
    # two shards read the whole input each: every repeat's error in exactly one of them
    sharded = tmp_path / "s"
    for i in (0, 1):
        invoke(args(model, dup_dataset, sharded, "--num-shards", "2", "--shard-index", str(i)))
    r = invoke(["merge", str(sharded)])
    assert "0 missing, 0 duplicate" in r.output
    merged_results, merged_errors = committed(sharded / "merged")
    check_duplicate_errors(merged_results, merged_errors)
    assert merged_results == results


def interrupt(argv: list[str], out: Path, rows: int, stdin: Path | None = None) -> None:
    """Run until `rows` rows are committed, then SIGTERM: exit 5, partly committed."""
    proc = spawn(argv, stdin)
    assert wait_for(proc, out, rows), proc.communicate()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 5, err
    assert manifest(out)["ledger_rows"] < NUM_ROWS


def test_standard_input_run_resumes_from_its_spool(model, dataset, baseline, tmp_path):
    out = tmp_path / "o"
    argv = args(model, "-", out, "--max-running", "2")
    interrupt(argv, out, 6, stdin=dataset)
    assert (out / "stdin.jsonl").read_bytes() == dataset.read_bytes()
    result = CliRunner().invoke(main, argv, input=dataset.read_bytes())
    assert result.exit_code == 0 and "resuming" in result.output, result.output
    check_complete(out, baseline)


def test_export_of_an_interrupted_then_resumed_run(model, dataset, baseline, tmp_path):
    """n = 2 samples a row, error rows, an interrupted run exported as far as it committed,
    then resumed and exported whole: input order, the input rows joined."""
    out = tmp_path / "o"
    argv = args(model, dataset, out, "--max-running", "2", "--n", "2", "--keep-columns", "id")
    interrupt(argv, out, 6)
    lines = dataset.read_text().splitlines()

    def exported() -> list[dict]:
        invoke(["export", str(out), "--format", "jsonl"])
        return [json.loads(x) for x in (out / "export.jsonl").read_text().splitlines()]

    partial = exported()
    keys = [(r["row"], r.get("index", 0)) for r in partial]
    assert keys == sorted(keys) and 6 <= len({r for r, _ in keys}) < NUM_ROWS
    invoke(argv)
    records = exported()
    expected = []
    for row, line in enumerate(lines):
        expected += [(row, 0)] if line.startswith("{not") else [(row, 0), (row, 1)]
    assert [(r["row"], r.get("index", 0)) for r in records] == expected
    for r in records:
        line = lines[r["row"]]
        if line.startswith("{not"):
            assert r["input"] is None and r["error"]["type"] == "invalid_json"
        else:
            assert r["input"] == json.loads(line) and r["id"] == r["input"]["id"]
            assert r["text"] == baseline[r["id"]][0]  # greedy: both samples as the baseline
