"""`batchrun inspect OUT`: a run directory's manifest, checked against the files on disk."""

from __future__ import annotations

from pathlib import Path

from batchrun.io.manifest import read_manifest


class InspectError(Exception):
    pass


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


def inspect_run(out: str | Path) -> str:
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
        f"tokens       prompt {c.prompt_tokens:,} (cached "
        f"{100.0 * c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0:.1f}%), "
        f"output {c.completion_tokens:,}",
    ]
    problems = []
    for f in m.files:
        path = out / f.path
        if not path.is_file():
            problems.append(f"{f.path}: listed in the manifest but missing")
            continue
        size = path.stat().st_size
        length = f.bytes if f.bytes is not None else size
        n = _count_lines(path, length)
        if n != f.rows:
            problems.append(f"{f.path}: {n} lines on disk, manifest says {f.rows}")
        if size > length:  # a crash after an append, before its commit
            problems.append(f"{f.path}: {size - length} uncommitted bytes (cut on resume)")
        elif size < length:
            problems.append(f"{f.path}: shorter than its committed {length} bytes")
    lines.append(
        f"files        {len(m.files)}: " + ", ".join(f"{f.path} ({f.rows})" for f in m.files)
    )
    lines.append("check        " + ("ok" if not problems else "; ".join(problems)))
    return "\n".join(lines)
