"""Commit protocol (append + fsync, manifest as the commit record), resume repair, injected write
errors, shard selection and fingerprints."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import msgspec
import pytest

from batchrun.errors import RunError
from batchrun.io.manifest import Counts, InputInfo, Manifest, read_manifest, utc_now
from batchrun.io.writer import RowLedger, ShardedWriter, read_ledger
from batchrun.job.commit import RunOutput
from batchrun.job.resume import fingerprint_diff
from batchrun.job.shards import ShardOptionError, error_shard_of, resolve_shards, shard_dir


def make_manifest(**fp) -> Manifest:
    return Manifest(
        created=utc_now(),
        model="m",
        input=InputInfo("in.jsonl", "jsonl"),
        fingerprint={"model": {"config": "abc"}, "sampling": {"max_new_tokens": 8}, **fp},
    )


def line(row: int) -> bytes:
    return msgspec.json.encode({"id": f"r{row}", "row": row}) + b"\n"


def fill(run: RunOutput, rows: range) -> None:
    for r in rows:
        if r % 5 == 4:
            run.add_error(r, line(r))
        else:
            run.add_result(r, [line(r)])


def committed_rows(out: Path) -> list[int]:
    m = read_manifest(out)
    return sorted(read_ledger(out, m.ledger_rows).tolist())


def test_commit_then_crash_tail_is_cut_on_resume(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = RunOutput.open(out, make_manifest(), shard_size=4, overwrite=False)
    fill(run, range(7))
    run.commit(Counts(rows_total=7))
    # a crash after appending, before the manifest: a torn line and an unlisted new shard
    with open(out / "results-00001.jsonl", "ab") as f:
        f.write(line(7) + b'{"id": "r8", "ro')
    (out / "results-00002.jsonl").write_bytes(line(9))
    with open(out / RowLedger.NAME, "ab") as f:
        f.write(b"\x07\x00\x00")
    again = RunOutput.open(out, make_manifest(), shard_size=4, overwrite=False)
    assert any("uncommitted bytes" in n for n in again.notes)
    assert any("results-00002.jsonl: removed" in n for n in again.notes)
    assert not (out / "results-00002.jsonl").exists()
    assert [again.is_committed(r) for r in range(9)] == [True] * 7 + [False] * 2
    for p in out.glob("*.jsonl"):
        for raw in p.read_bytes().splitlines():
            msgspec.json.decode(raw)  # no torn line survives
    fill(again, range(7, 10))
    again.commit(Counts(rows_total=10), status="complete")
    assert committed_rows(out) == list(range(10))
    rows = [msgspec.json.decode(x)["row"] for p in out.glob("*.jsonl") for x in p.open("rb")]
    assert sorted(rows) == list(range(10))
    # complete: opening it again changes nothing
    done = RunOutput.open(out, make_manifest(), shard_size=4, overwrite=False)
    assert done.is_complete


def test_fingerprint_mismatch_and_foreign_directory_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = RunOutput.open(out, make_manifest(), 4, overwrite=False)
    run.commit(Counts())
    other = make_manifest(sampling={"max_new_tokens": 9})
    with pytest.raises(RunError, match="sampling defaults: --max-tokens 8 -> 9.*--overwrite"):
        RunOutput.open(out, other, 4, overwrite=False)
    fresh = RunOutput.open(out, other, 4, overwrite=True)
    assert fresh.num_committed_rows == 0 and not (out / "manifest.json").exists()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("x")
    with pytest.raises(RunError, match="no batchrun manifest"):
        RunOutput.open(tmp_path / "foreign", make_manifest(), 4, overwrite=False)


@pytest.mark.parametrize("fail", ["write", "fsync", "manifest"])
def test_injected_write_error_keeps_committed_state(tmp_path, monkeypatch, fail) -> None:
    out = tmp_path / "run"
    run = RunOutput.open(out, make_manifest(), shard_size=3, overwrite=False)
    fill(run, range(5))
    run.commit(Counts(rows_total=5))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    fill(run, range(5, 9))
    real = {"write": os.write, "fsync": os.fsync}
    calls = {"n": 0}

    def broken(name):
        def f(*args):
            calls["n"] += 1
            # let the first call through for "manifest": the failure hits a later stage
            if fail != "manifest" or calls["n"] > 3:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real[name](*args)

        return f

    name = "write" if fail == "write" else "fsync"
    monkeypatch.setattr(os, name, broken(name))
    with pytest.raises(RunError, match="No space left on device.*resume"):
        run.commit(Counts(rows_total=9))
    monkeypatch.undo()
    after = {p.name: p.read_bytes() for p in out.iterdir() if not p.name.startswith(".")}
    assert after == before  # cut back to the last commit, manifest untouched
    again = RunOutput.open(out, make_manifest(), 3, overwrite=False)
    assert again.num_committed_rows == 5 and not again.notes


def test_ledger_and_writer_refuse_damage(tmp_path: Path) -> None:
    w = ShardedWriter(tmp_path, "results", 10)
    w.add(line(0))
    w.commit()
    (tmp_path / "results-00000.jsonl").write_bytes(b"")
    with pytest.raises(Exception, match="committed"):
        ShardedWriter(tmp_path, "results", 10, files=w.files).repair()
    with pytest.raises(Exception, match="committed 3"):
        RowLedger(tmp_path, committed=3).repair()


def test_resolve_shards_from_options_and_slurm_env() -> None:
    assert resolve_shards(None, None, {}) == (1, 0)
    assert resolve_shards(4, 2, {}) == (4, 2)
    env = {"SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "5"}
    assert resolve_shards(None, None, env) == (3, 2)
    step = {"SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_ID": "6", "SLURM_ARRAY_TASK_STEP": "2"}
    assert resolve_shards(None, None, step) == (4, 3)
    assert resolve_shards(2, 1, env) == (2, 1)  # options win
    for bad in [(2, 2, {}), (None, 1, {}), (0, 0, {})]:
        with pytest.raises(ShardOptionError):
            resolve_shards(*bad)
    assert shard_dir("o", 1, 0) == Path("o") and shard_dir("o", 2, 1) == Path("o/shard-1")


def test_error_shards_cover_every_row_once() -> None:
    for n in (1, 2, 5):
        shards = [error_shard_of(r, n) for r in range(2000)]
        assert set(shards) == set(range(n))
        assert shards == [error_shard_of(r, n) for r in range(2000)]  # deterministic


def test_fingerprint_diff_names_what_changed() -> None:
    a = {"model": {"config": "x"}, "order": ["prefix", 10], "shards": [2, 0]}
    assert fingerprint_diff(a, dict(a)) == []
    b = {**a, "order": ("input", 10), "model": {"config": "y"}}
    diff = fingerprint_diff(a, b)
    assert len(diff) == 2 and any("was ['prefix', 10], now ['input', 10]" in d for d in diff)
    assert fingerprint_diff(a, {**a, "shards": [2, 1]}, ignore=("shards",)) == []


def test_stop_signals_flag_and_restore() -> None:
    import signal

    from batchrun.job.signals import StopSignals

    before = signal.getsignal(signal.SIGUSR1)
    with StopSignals(drain_timeout=0.0) as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested and stop.signal_name == "SIGUSR1" and stop.drain_expired
    assert signal.getsignal(signal.SIGUSR1) == before
