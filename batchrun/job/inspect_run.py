"""`batchrun inspect OUT`: a run directory's manifest, checked against the files on disk."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from batchrun.io.manifest import Manifest, read_manifest
from batchrun.io.writer import RowLedger
from batchrun.job.run_lock import is_locked, read_lock
from batchrun.job.summary import describe_errors, errors_path


class InspectError(Exception):
    pass


@dataclass(frozen=True)
class InspectReport:
    text: str
    damaged: bool  # committed records are missing or disagree with the manifest


def _count_lines(path: Path, length: int) -> int:
    """Lines within the first ``length`` (committed) bytes."""
    num, left = 0, length
    with open(path, "rb") as f:
        while left > 0:
            chunk = f.read(min(left, 1 << 22))
            if not chunk:
                break
            num += chunk.count(b"\n")
            left -= len(chunk)
    return num


def inspect_run(out: str | Path) -> InspectReport:
    out = Path(out)
    try:
        m = read_manifest(out)
    except ValueError as e:
        raise InspectError(str(e)) from e
    if m is None:
        if any(out.glob("shard-*/manifest.json")):
            raise InspectError(
                f"{out} holds a sharded run: inspect one shard ({out}/shard-0, ...) or check and "
                f"combine them with `batchrun merge {out}` (then `batchrun inspect {out}/merged`)"
            )
        raise InspectError(f"{out} has no manifest.json: not a batchrun output directory")
    c = m.counts
    status, resume = _status(out, m)
    lines = [
        f"run          {out}",
        f"status       {status} (created {m.created}"
        + (f", finished {m.finished})" if m.finished else ")"),
        f"batchrun     {m.batchrun_version}",
        f"model        {m.model}",
        f"input        {m.input.path} ({m.input.format}"
        + (f", split {m.input.split})" if m.input.split else ")"),
        f"rows         {c.rows_total}: {c.rows_ok} ok, {c.rows_failed} failed; "
        f"{c.completions} completions",
    ]
    if c.rows_failed and c.error_types:
        errors = [f.path for f in m.files if f.path.startswith("errors-")]
        lines.append(f"errors       {describe_errors(c.error_types)} -> {errors_path(out, errors)}")
    lines += [
        f"tokens       prompt {c.prompt_tokens:,} (cached "
        f"{100.0 * c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0:.1f}%), "
        f"output {c.completion_tokens:,}",
        f"files        {len(m.files)}: " + ", ".join(f"{f.path} ({f.rows})" for f in m.files),
    ]
    damage, notes = _check(out, m)
    lines.append("check        " + ("; ".join(damage + notes) if damage or notes else "ok"))
    if resume is not None:
        lines.append(f"resume       {resume}")
    if damage:
        lines.append(
            "repair       committed records are gone: the same `batchrun submit` command runs "
            "their rows again (or says why it cannot); --overwrite starts over"
        )
    return InspectReport("\n".join(lines), bool(damage))


def _status(out: Path, m: Manifest) -> tuple[str, str | None]:
    """The run's status as it stands (a manifest that says "running" while no live process
    holds the run's lock is an interrupted run), and the command that resumes it (None when
    there is nothing to resume)."""
    info = read_lock(out)
    status = m.status
    if status == "running":
        if is_locked(out):
            who = f"process {info.pid} on {info.host}" if info.pid else "a live process"
            return f"running ({who} holds the run's lock)", None
        status = (
            "interrupted (no process runs it: it was killed, or stopped before its final commit)"
        )
    elif status not in ("interrupted", "failed"):
        return status, None
    if info.command:
        where = f"cd {shlex.quote(info.cwd)} && " if info.cwd else ""
        return status, f"{where}{info.command}  (the command that ran it: committed rows kept)"
    return status, "run the same `batchrun submit` command again (committed rows are kept)"


def _check(out: Path, m: Manifest) -> tuple[list[str], list[str]]:
    """(damage: committed bytes gone or disagreeing with the manifest, notes: harmless)."""
    damage, notes = [], []
    for f in m.files:
        path = out / f.path
        if not path.is_file():
            damage.append(f"{f.path}: listed in the manifest but missing")
            continue
        size = path.stat().st_size
        length = f.bytes if f.bytes is not None else size
        n = _count_lines(path, length)
        if n != f.rows:
            damage.append(f"{f.path}: {n} lines on disk, manifest says {f.rows}")
        if size > length:  # a crash after an append, before its commit
            notes.append(f"{f.path}: {size - length} uncommitted bytes (cut on resume)")
        elif size < length:
            damage.append(f"{f.path}: shorter than its committed {length} bytes")
    ledger = out / RowLedger.NAME
    have = ledger.stat().st_size // RowLedger.DTYPE.itemsize if ledger.is_file() else 0
    if have < m.ledger_rows:
        damage.append(f"{RowLedger.NAME}: {have} rows on disk, manifest says {m.ledger_rows}")
    c = m.counts
    results = sum(f.rows for f in m.files if f.path.startswith("results-"))
    errors = sum(f.rows for f in m.files if f.path.startswith("errors-"))
    # a line per completion (n per row), or per row (OpenAI Batch output: n choices in one)
    if (m.ledger_rows, errors) != (c.rows_total, c.rows_failed) or results not in (
        c.completions,
        c.rows_ok,
    ):
        damage.append(
            f"the manifest disagrees with itself: {m.ledger_rows} rows in the ledger, "
            f"{c.rows_total} counted; {errors} error lines, {c.rows_failed} failed rows; "
            f"{results} result lines, {c.completions} completions"
        )
    return damage, notes
