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


def record(row: int, index: int | None = None) -> bytes:
    rec = {"id": f"r{row}", "text": "t", "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    if index is not None:
        rec["index"] = index
    return msgspec.json.encode({**rec, "row": row}) + b"\n"


def fill_multi(run: RunOutput, rows: range) -> None:
    """Rows with n = 1, n = 3 (every third row) and errors (every fifth)."""
    for r in rows:
        if r % 5 == 4:
            run.add_error(r, error_line(r))
        elif r % 3 == 0:
            run.add_result(r, [record(r, i) for i in range(3)])
        else:
            run.add_result(r, [record(r)])


def error_line(row: int) -> bytes:
    err = {"id": f"r{row}", "row": row, "error": {"type": "invalid_json", "message": "m"}}
    return msgspec.json.encode(err) + b"\n"


def complete_run(out: Path, rows: range, shard_size: int = 5) -> None:
    """Shards of 5 lines: row 6's 3 lines run from the second file into the third."""
    run = RunOutput.open(out, make_manifest(), shard_size, overwrite=False)
    fill_multi(run, rows)
    run.commit(Counts(rows_total=len(rows)), status="complete")
    run.close()


def resume_and_finish(out: Path, rows: range) -> RunOutput:
    """What submit does: open, run the rows not committed, commit complete."""
    run = RunOutput.open(out, make_manifest(), 4, overwrite=False)
    assert not run.is_complete
    fill_multi(run, range(0))
    for r in rows:
        if not run.is_committed(r):
            fill_multi(run, range(r, r + 1))
    run.commit(Counts(rows_total=len(rows)), status="complete")
    run.close()
    return run


def records_by_row(out: Path) -> dict[int, list]:
    """row -> its records' indices; asserts every committed line is whole and listed."""
    m = read_manifest(out)
    found: dict[int, list] = {}
    for f in m.files:
        data = (out / f.path).read_bytes()
        assert len(data) == f.bytes and data.count(b"\n") == f.rows
        for raw in data.splitlines():
            rec = msgspec.json.decode(raw)
            found.setdefault(rec["row"], []).append(rec.get("index"))
    assert sorted(found) == committed_rows(out)
    return found


def expected(rows: range) -> dict[int, list]:
    return {r: [None] if r % 5 == 4 or r % 3 else [0, 1, 2] for r in rows}


@pytest.mark.parametrize(
    "damage",
    ["truncate", "cut_line", "delete", "delete_middle", "ledger", "ledger_and_file"],
)
def test_damaged_committed_records_run_again(tmp_path: Path, damage: str) -> None:
    """A complete run whose committed bytes are partly gone is not complete: the rows that lost
    a record (a row of n lines next to the damage included) run again, the intact ones stay,
    and the end result has every row exactly once with all its lines."""
    out, rows = tmp_path / "run", range(20)
    complete_run(out, rows)
    files = sorted(out.glob("results-*.jsonl"))
    assert len(files) >= 4
    ledger = out / RowLedger.NAME
    if damage == "truncate":
        files[-1].write_bytes(b"".join(files[-1].read_bytes().splitlines(True)[:-2]))
    elif damage == "cut_line":
        files[1].write_bytes(files[1].read_bytes()[:-5])
    elif damage == "delete":
        (out / "errors-00000.jsonl").unlink()
    elif damage == "delete_middle":
        files[1].unlink()
    elif damage == "ledger":
        ledger.write_bytes(ledger.read_bytes()[:16])
    else:
        ledger.unlink()
        files[2].write_bytes(files[2].read_bytes()[:-1])  # the newline of its last line
    before = read_manifest(out).counts.rows_total
    again = RunOutput.open(out, make_manifest(), 4, overwrite=False)
    m = read_manifest(out)
    kept = records_by_row(out)  # what is left is whole and consistent with the ledger
    assert all(kept[r] == expected(rows)[r] for r in kept)
    assert m.counts.rows_total == len(kept) == m.ledger_rows
    assert m.counts.rows_failed == sum(1 for r in kept if r % 5 == 4)
    assert m.counts.completions == sum(len(v) for r, v in kept.items() if r % 5 != 4)
    assert m.counts.prompt_tokens == 3 * m.counts.completions
    if damage == "ledger":  # the records are all there: nothing runs again
        assert again.is_complete and len(kept) == before
        assert any("rebuilt" in n for n in again.notes)
        return
    assert not again.is_complete and m.status == "running" and len(kept) < before
    assert any("run again" in n for n in again.notes)
    again.close()
    resume_and_finish(out, rows)
    assert records_by_row(out) == expected(rows)


def test_salvage_interrupted_by_a_crash_converges(tmp_path: Path, monkeypatch) -> None:
    out, rows = tmp_path / "run", range(20)
    complete_run(out, rows)
    files = sorted(out.glob("results-*.jsonl"))
    files[1].unlink()  # rows of files[0] and files[2] next to it are rewritten away

    def crash(*a):
        raise OSError(5, "crash before the manifest")

    monkeypatch.setattr("batchrun.job.salvage.write_manifest", crash)
    with pytest.raises(RunError):
        RunOutput.open(out, make_manifest(), 4, overwrite=False)
    monkeypatch.undo()
    resume_and_finish(out, rows)
    assert records_by_row(out) == expected(rows)


def test_damaged_openai_output_is_refused_with_how_to_repair(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = RunOutput.open(out, make_manifest(), 4, overwrite=False)
    for r in range(6):
        run.add_result(
            r, [msgspec.json.encode({"id": "batch_req_x", "custom_id": f"c{r}"}) + b"\n"]
        )
    run.commit(Counts(rows_total=6), status="complete")
    (out / "results-00001.jsonl").unlink()
    with pytest.raises(RunError, match="no input row number.*--overwrite"):
        RunOutput.open(out, make_manifest(), 4, overwrite=False)
    assert read_manifest(out).is_complete  # untouched: nothing is decided for the user
    assert RunOutput.open(out, make_manifest(), 4, overwrite=True).num_committed_rows == 0


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
    # sampling fields at their defaults are not in a fingerprint: the diff shows the default
    diff = fingerprint_diff({**a, "sampling": {}}, {**a, "sampling": {"max_new_tokens": 64}})
    assert diff == ["sampling defaults: --max-tokens 128 -> 64"]


def test_stop_signals_flag_and_restore() -> None:
    import signal

    from batchrun.job.signals import StopSignals

    before = signal.getsignal(signal.SIGUSR1)
    with StopSignals(drain_timeout=0.0) as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested and stop.signal_name == "SIGUSR1" and stop.drain_expired
    assert signal.getsignal(signal.SIGUSR1) == before
