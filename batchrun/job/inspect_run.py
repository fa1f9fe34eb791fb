"""`batchrun inspect OUT`: a run directory's manifest, checked against the files on disk."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batchrun.io.manifest import Manifest, read_manifest
from batchrun.io.writer import RowLedger
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
    lines = [
        f"run          {out}",
        f"status       {m.status} (created {m.created}"
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
    if damage:
        lines.append(
            "repair       committed records are gone: the same `batchrun submit` command runs "
            "their rows again (or says why it cannot); --overwrite starts over"
        )
    return InspectReport("\n".join(lines), bool(damage))


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
