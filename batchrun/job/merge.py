"""`batchrun merge OUT`: check a sharded run and combine its shards into one view.

Checks, reading only what the shards committed (their manifests and row ledgers) and the input:

- every shard 0..N-1 exists, is complete, and has the same fingerprint (model, input, sampling,
  ...) apart from its index; every listed file holds its committed bytes and lines;
- every input row is committed exactly once across the shards: rows committed nowhere are
  reported as missing, rows committed more than once as duplicates (with their ids, read back
  from the input as ``submit`` reads them: id column, ``custom_id`` or row number).

When all holds, ``OUT/merged/`` is written: ``results-*.jsonl``, ``errors-*.jsonl`` and an
embed run's ``vectors-*.parquet`` (hard links to the shards' files, copies where links are not
possible, renumbered in shard order), ``rows-committed.bin`` and a ``manifest.json`` with the
summed counts, so ``batchrun inspect OUT/merged`` and
``datasets.load_dataset("json", data_files="OUT/merged/results-*.jsonl")`` work on it. It is
replaced as a whole (built in ``OUT/.merged.tmp``, then renamed).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from batchrun.io.manifest import Counts, Manifest, read_manifest, write_manifest
from batchrun.io.readers import BadInputError, open_dataset
from batchrun.io.rows import RowError, RowSpec, detect_openai_batch, prepare_row
from batchrun.io.writer import RowLedger, ShardFile, fsync_dir, read_ledger
from batchrun.job.pipeline import read_rows
from batchrun.job.resume import fingerprint_diff
from batchrun.job.shards import SHARD_DIR_PREFIX
from batchrun.params import SamplingParams

MERGED_DIR = "merged"
_SHARD_RE = re.compile(rf"^{SHARD_DIR_PREFIX}(\d+)$")


class MergeError(Exception):
    """OUT or the input cannot be read at all."""


@dataclass
class MergeReport:
    out: Path
    num_shards: int = 0
    shard_lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    num_input_rows: int = 0
    num_committed: int = 0
    missing: list[int] = field(default_factory=list)  # row numbers (all of them)
    duplicates: list[int] = field(default_factory=list)
    ids: dict[int, str] = field(default_factory=dict)  # row -> id, for the rows shown
    holders: dict[int, list[int]] = field(default_factory=dict)  # duplicate row -> shards
    merged: Path | None = None
    merged_files: int = 0
    show: int = 20

    @property
    def ok(self) -> bool:
        return not (self.problems or self.missing or self.duplicates)

    def _rows(self, rows: list[int], with_shards: bool = False) -> str:
        parts = []
        for r in rows[: self.show]:
            where = ""
            if with_shards:
                where = " in " + ", ".join(f"shard-{s}" for s in self.holders.get(r, []))
            parts.append(f"id {self.ids.get(r, '?')!r} (row {r}){where}")
        more = f", ... ({len(rows) - self.show} more)" if len(rows) > self.show else ""
        return "; ".join(parts) + more

    def text(self) -> str:
        lines = [f"merge        {self.out}: {self.num_shards} shard(s)"]
        lines += [f"  {line}" for line in self.shard_lines]
        lines.append(
            f"rows         {self.num_input_rows:,} in the input; {self.num_committed:,} committed, "
            f"{len(self.missing):,} missing, {len(self.duplicates):,} duplicate"
        )
        if self.missing:
            lines.append(f"missing      {self._rows(self.missing)}")
        if self.duplicates:
            lines.append(f"duplicate    {self._rows(self.duplicates, with_shards=True)}")
        for p in self.problems:
            lines.append(f"problem      {p}")
        if self.merged is not None:
            lines.append(f"merged       {self.merged}: {self.merged_files} files")
        elif not self.ok:
            lines.append(
                "not merged   fix the above (run the missing or incomplete shards again: they "
                "resume), then run batchrun merge again"
            )
        else:
            lines.append("check        ok (not sharded: nothing to merge)")
        return "\n".join(lines)


def shard_dirs(out: Path) -> dict[int, Path]:
    found = {}
    for p in out.iterdir():
        m = _SHARD_RE.match(p.name)
        if m and p.is_dir():
            found[int(m.group(1))] = p
    return dict(sorted(found.items()))


def merge_run(out: str | Path, show: int = 20, write: bool = True) -> MergeReport:
    out = Path(out)
    if not out.is_dir():
        raise MergeError(f"{out} is not a directory")
    report = MergeReport(out, show=show)
    dirs = shard_dirs(out)
    if not dirs:
        if read_manifest(out) is None:
            raise MergeError(f"{out} has no shard-*/ directories and no manifest.json")
        dirs = {0: out}
    manifests = _read_manifests(dirs, report)
    if not manifests:
        raise MergeError(f"{out}: no shard has a readable manifest.json")
    ref = next(iter(manifests.values()))
    report.num_shards = ref.num_shards
    _check_shards(dirs, manifests, ref, report)
    expected = _input_rows(ref)
    report.num_input_rows = int(expected.sum())
    counts = np.zeros(len(expected), dtype=np.int64)
    ledgers = {i: read_ledger(dirs[i], m.ledger_rows) for i, m in manifests.items()}
    for i, rows in ledgers.items():
        report.num_committed += len(rows)
        outside = rows[rows >= len(expected)]
        inside = rows[rows < len(expected)]
        counts += np.bincount(inside.astype(np.int64), minlength=len(expected))
        if len(outside) or (~expected[inside]).any():
            report.problems.append(f"shard-{i}: commits rows that are not in the input")
    report.missing = np.flatnonzero(expected & (counts == 0)).tolist()
    report.duplicates = np.flatnonzero(counts > 1).tolist()
    for r in report.duplicates[:show]:
        report.holders[r] = [i for i, rows in ledgers.items() if (rows == r).any()]
    if report.missing or report.duplicates:
        report.ids = _row_ids(ref, set(report.missing[:show] + report.duplicates[:show]))
    if report.ok and write and dirs != {0: out}:
        _write_merged(out, dirs, manifests, report)
    return report


def _read_manifests(dirs: dict[int, Path], report: MergeReport) -> dict[int, Manifest]:
    manifests = {}
    for i, d in dirs.items():
        try:
            m = read_manifest(d)
        except ValueError as e:
            report.problems.append(f"shard-{i}: {e}")
            continue
        if m is None:
            report.problems.append(f"shard-{i}: no manifest.json (the task never started?)")
            continue
        manifests[i] = m
        c = m.counts
        report.shard_lines.append(
            f"{d.name:<12} {m.status:<12} {c.rows_total:,} rows ({c.rows_ok:,} ok, "
            f"{c.rows_failed:,} failed), {len(m.files)} files"
        )
    return manifests


def _check_shards(
    dirs: dict[int, Path], manifests: dict[int, Manifest], ref: Manifest, report: MergeReport
) -> None:
    n = ref.num_shards
    for i in range(n):
        if i not in dirs:
            report.problems.append(f"shard-{i}: missing (run shard/array task {i} of {n})")
    for i, m in manifests.items():
        if m.num_shards != n or (len(dirs) > 1 and m.shard_index != i) or i >= n:
            report.problems.append(
                f"shard-{i}: is shard {m.shard_index} of {m.num_shards}, expected {i} of {n}"
            )
            continue
        diff = fingerprint_diff(ref.fingerprint, m.fingerprint, ignore=("shards",))
        if diff:
            report.problems.append(f"shard-{i}: a different run ({'; '.join(diff)})")
        if not m.is_complete:
            report.problems.append(
                f"shard-{i}: not complete ({m.status}, {m.ledger_rows:,} rows committed); run "
                "its task again to resume it"
            )
        for f in m.files:
            problem = _check_file(dirs[i] / f.path, f)
            if problem:
                report.problems.append(f"shard-{i}: {problem}")


def _check_file(path: Path, f: ShardFile) -> str | None:
    if not path.is_file():
        return f"{f.path} is listed but missing"
    length = f.bytes if f.bytes is not None else path.stat().st_size
    if path.stat().st_size < length:
        return f"{f.path} is shorter than its committed {length} bytes"
    if f.path.endswith(".parquet"):  # an embed run's vectors (written whole, atomically)
        import pyarrow.parquet as pq  # local: merge starts without pyarrow otherwise

        rows = pq.ParquetFile(path).metadata.num_rows
        return None if rows == f.rows else f"{f.path}: {rows} rows, manifest says {f.rows}"
    lines, left = 0, length
    with open(path, "rb") as fh:
        while left:
            chunk = fh.read(min(left, 1 << 22))
            if not chunk:
                break
            lines += chunk.count(b"\n")
            left -= len(chunk)
    if lines != f.rows:
        return f"{f.path}: {lines} lines committed, manifest says {f.rows}"
    return None


def _source(ref: Manifest):
    try:
        return open_dataset(ref.input.path, ref.input.split)
    except BadInputError as e:
        raise MergeError(f"cannot read the run's input to check ids: {e}") from e


def _input_rows(ref: Manifest) -> np.ndarray:
    """Bitmap of the input's row numbers (JSONL blank lines have none)."""
    seen = np.zeros(1 << 16, dtype=bool)
    top = -1
    for batch in read_rows(_source(ref), ref.config.get("limit"), 8192):
        last = batch[-1].row
        if last >= len(seen):
            seen = np.concatenate([seen, np.zeros(max(last + 1, 2 * len(seen)) - len(seen), bool)])
        seen[[r.row for r in batch]] = True
        top = last
    return seen[: top + 1]


def _row_ids(ref: Manifest, rows: set[int]) -> dict[int, str]:
    """The ids of some rows, derived exactly as submit derives them."""
    spec = RowSpec(**ref.config.get("spec", {}))
    ids: dict[int, str] = {}
    openai = None
    for batch in read_rows(_source(ref), ref.config.get("limit"), 8192):
        if openai is None:
            first = next((r.data for r in batch if r.data is not None), None)
            if first is not None:
                openai = detect_openai_batch(first)
        for raw in batch:
            if raw.row in rows:
                item = prepare_row(raw, spec, SamplingParams(), bool(openai))
                ids[raw.row] = item.id if not isinstance(item, RowError) else item.id
        if len(ids) == len(rows):
            break
    return ids


def _write_merged(
    out: Path, dirs: dict[int, Path], manifests: dict[int, Manifest], report: MergeReport
) -> None:
    tmp = out / ".merged.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    files: list[ShardFile] = []
    counts = Counts()
    ledgers = []
    for prefix, suffix in (("results", "jsonl"), ("errors", "jsonl"), ("vectors", "parquet")):
        k = 0
        for i, m in manifests.items():
            for f in m.files:
                if not f.path.startswith(prefix + "-"):
                    continue
                name = f"{prefix}-{k:05d}.{suffix}"
                _link_or_copy(dirs[i] / f.path, tmp / name, f.bytes)
                files.append(ShardFile(name, f.rows, f.bytes))
                k += 1
    for i, m in manifests.items():
        for name in counts.__struct_fields__:
            if name == "error_types":
                for kind, n in m.counts.error_types.items():
                    counts.error_types[kind] = counts.error_types.get(kind, 0) + n
            else:
                setattr(counts, name, getattr(counts, name) + getattr(m.counts, name))
        ledgers.append(read_ledger(dirs[i], m.ledger_rows))
    np.concatenate(ledgers).astype(RowLedger.DTYPE).tofile(tmp / RowLedger.NAME)
    ref = next(iter(manifests.values()))
    merged = Manifest(
        batchrun_version=ref.batchrun_version,
        status="complete",
        created=min(m.created for m in manifests.values()),
        finished=max(m.finished or "" for m in manifests.values()) or None,
        model=ref.model,
        input=ref.input,
        config={**ref.config, "merged_from": [dirs[i].name for i in manifests]},
        counts=counts,
        files=files,
        ledger_rows=report.num_committed,
        num_shards=ref.num_shards,
        shard_index=0,
        fingerprint={**ref.fingerprint, "shards": [ref.num_shards, "merged"]},
    )
    write_manifest(tmp, merged)
    final = out / MERGED_DIR
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(out)
    report.merged = final
    report.merged_files = len(files)


def _link_or_copy(src: Path, dst: Path, length: int | None) -> None:
    if length is None or src.stat().st_size == length:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass  # another file system, or no hard links: copy
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        left = length if length is not None else src.stat().st_size
        while left:
            chunk = fi.read(min(left, 1 << 22))
            if not chunk:
                break
            fo.write(chunk)
            left -= len(chunk)
