"""Committed records that are gone, found cheaply, and the rows that run again because of it.

The commit protocol never shortens a committed file; a file deleted, truncated or replaced outside
batchrun (a `head -n` into the same name, a half-restored backup, a full disk on another tool's
copy) does. ``find_damage`` compares sizes with the manifest (a stat per file, no reading), so a
healthy run pays nothing. ``salvage`` reads the run's records once and turns the directory into a
smaller valid committed state: every row whose records are all intact stays committed, every other
row leaves the ledger and runs again on resume, so the output ends up with every row exactly once.

Plain records carry their input ``row``; a row's n lines are written together, one after the
other (they may run on into the next shard file), so a row is intact unless the damage cut
through its lines:

    results stream:  | row 4 | row 9 (index 0, 1) | row 2 (index 0 | <gone> | 1, 2) | row 7 |
                                                  ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
                     a row of n > 1 lines next to a gap may have lost lines: it runs again;
                     a line without "index" (n = 1) is a whole row

OpenAI Batch records carry no row number (``custom_id`` is the user's), so the rows they held
cannot be told apart from the rest: ``salvage`` refuses, saying how to repair.

Crash safety: files are rewritten (atomically, in file order) before the ledger and then the
manifest. A crash in between leaves files shorter than the old manifest says, which the next
``find_damage`` sees, and the salvage runs again on what is left.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np

from batchrun.errors import RunError
from batchrun.io.manifest import Counts, Manifest, write_manifest
from batchrun.io.writer import RowLedger, ShardFile, read_ledger, write_bytes_atomic


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class _ErrorInfo(msgspec.Struct):
    type: str = "unknown"


class _Record(msgspec.Struct):
    """What salvage reads of a result or error line."""

    row: int | None = None
    index: int | None = None
    usage: _Usage | None = None
    error: _ErrorInfo | None = None
    custom_id: str | None = None


_decode = msgspec.json.Decoder(_Record).decode


def find_damage(out: Path, m: Manifest) -> list[str]:
    """What of the committed bytes is gone, by size alone (no file is read)."""
    damage = []
    for f in m.files:
        path = out / f.path
        if not path.is_file():
            damage.append(f"{f.path} is missing")
        elif f.bytes is not None and path.stat().st_size < f.bytes:
            damage.append(f"{f.path} is shorter than its committed {f.bytes:,} bytes")
    ledger = out / RowLedger.NAME
    have = ledger.stat().st_size // RowLedger.DTYPE.itemsize if ledger.is_file() else 0
    if have < m.ledger_rows:
        damage.append(f"{RowLedger.NAME} holds {have:,} of its {m.ledger_rows:,} committed rows")
    return damage


class _Rows:
    """A growable bitmap over input row numbers."""

    def __init__(self, rows: np.ndarray | None = None) -> None:
        size = int(rows.max()) + 1 if rows is not None and len(rows) else 0
        self.bits = np.zeros(max(size, 1024), dtype=bool)
        if rows is not None and len(rows):
            self.bits[rows] = True

    def __contains__(self, row: int) -> bool:
        return 0 <= row < len(self.bits) and bool(self.bits[row])

    def add(self, row: int) -> None:
        if row >= len(self.bits):
            self.bits = np.concatenate([self.bits, np.zeros(max(row + 1, len(self.bits)), bool)])
        self.bits[row] = True


class _Group:
    """The consecutive lines of one row in the results stream."""

    def __init__(self, row: int, multi: bool, after_gap: bool) -> None:
        self.row, self.multi, self.after_gap = row, multi, after_gap
        self.positions: list[tuple[int, int]] = []  # (file, line)
        self.usage = [0, 0, 0]

    def add(self, file: int, line: int, rec: _Record) -> None:
        self.positions.append((file, line))
        if rec.usage is not None:
            u = rec.usage
            self.usage = [
                self.usage[0] + u.prompt_tokens,
                self.usage[1] + u.completion_tokens,
                self.usage[2] + u.cached_tokens,
            ]


class _Salvage:
    def __init__(self, out: Path, ledger: np.ndarray | None) -> None:
        self.out = out
        self.ledger = ledger  # the committed row numbers, None when the ledger itself is damaged
        self.in_ledger = _Rows(ledger) if ledger is not None else None
        self.kept = _Rows()
        self.kept_order: list[int] = []  # kept rows as found (the new ledger without a ledger)
        self.counts = Counts()
        self.notes: list[str] = []

    def _keep(self, row: int) -> bool:
        """Whether a row whose records are whole stays committed (once)."""
        if row in self.kept or (self.in_ledger is not None and row not in self.in_ledger):
            return False
        self.kept.add(row)
        self.kept_order.append(row)
        return True

    def scan(self, files: list[ShardFile], results: bool) -> list[set[int] | None]:
        """Per file, the line numbers to remove (None: the file stays as it is)."""
        drops: list[set[int]] = [set() for _ in files]
        lost = [False] * len(files)
        group: _Group | None = None
        gap = False  # some committed lines are gone right before the next line

        def close(g: _Group, before_gap: bool) -> None:
            suspect = g.multi and (g.after_gap or before_gap)
            if not suspect and self._keep(g.row):
                c = self.counts
                c.rows_ok += 1
                c.completions += len(g.positions)
                c.prompt_tokens += g.usage[0]
                c.completion_tokens += g.usage[1]
                c.cached_tokens += g.usage[2]
            else:
                for i, j in g.positions:
                    drops[i].add(j)

        for i, f in enumerate(files):
            lines, lost[i] = _committed_lines(self.out, f)
            if lost[i]:
                self.notes.append(_describe_loss(self.out, f, len(lines)))
            for j, raw in enumerate(lines):
                rec = _record(raw)
                if rec is None:  # not a record (bytes replaced): its row, if any, runs again
                    drops[i].add(j)
                    gap = True
                    continue
                if rec.row is None:
                    raise _no_rows(self.out, f)
                if not results:
                    if self._keep(rec.row):
                        kind = rec.error.type if rec.error is not None else "unknown"
                        self.counts.rows_failed += 1
                        self.counts.error_types[kind] = self.counts.error_types.get(kind, 0) + 1
                    else:
                        drops[i].add(j)
                    continue
                if group is None or group.row != rec.row or gap:
                    if group is not None:
                        close(group, before_gap=gap)
                    group = _Group(rec.row, rec.index is not None, after_gap=gap)
                group.add(i, j, rec)
                gap = False
            gap = gap or lost[i]
        if group is not None:
            close(group, before_gap=gap)
        return [d if d or lost[i] else None for i, d in enumerate(drops)]

    def rewrite(self, files: list[ShardFile], drops: list[set[int] | None]) -> list[ShardFile]:
        """Each changed file rewritten with the lines it keeps; a file left empty goes."""
        out = []
        for f, drop in zip(files, drops, strict=True):
            if drop is None:
                out.append(f)
                continue
            lines, _ = _committed_lines(self.out, f)
            data = b"".join(line + b"\n" for j, line in enumerate(lines) if j not in drop)
            path = self.out / f.path
            if not data:
                path.unlink(missing_ok=True)
                continue
            write_bytes_atomic(path, data)
            out.append(ShardFile(f.path, data.count(b"\n"), len(data)))
        return out

    def new_ledger(self) -> np.ndarray:
        if self.ledger is None:
            return np.asarray(self.kept_order, dtype=RowLedger.DTYPE)
        rows = self.ledger.astype(np.int64)
        keep = rows < len(self.kept.bits)
        keep[keep] = self.kept.bits[rows[keep]]
        return self.ledger[keep]


def salvage(out: Path, m: Manifest, damage: list[str]) -> list[str]:
    """Make ``out`` a valid committed state without the rows whose records are gone (they run
    again); updates ``m`` and writes it. Returns what was done, for the user. Raises RunError
    when the records carry no row numbers."""
    ledger_ok = not any(d.startswith(RowLedger.NAME) for d in damage)
    s = _Salvage(out, read_ledger(out, m.ledger_rows) if ledger_ok else None)
    files = {p: [f for f in m.files if f.path.startswith(p)] for p in ("results-", "errors-")}
    drops = {p: s.scan(fs, results=p == "results-") for p, fs in files.items()}
    new_files = [f for p, fs in files.items() for f in s.rewrite(fs, drops[p])]
    rows = s.new_ledger()
    write_bytes_atomic(out / RowLedger.NAME, rows.tobytes())
    if not ledger_ok:
        s.notes.append(f"{RowLedger.NAME}: damaged; rebuilt from the records' row numbers")
    lost = m.ledger_rows - len(rows)
    s.counts.rows_total = s.counts.rows_ok + s.counts.rows_failed
    m.files, m.ledger_rows, m.counts = new_files, len(rows), s.counts
    if lost > 0 and m.is_complete:
        m.status, m.finished = "running", None
    write_manifest(out, m)
    if lost > 0:
        s.notes.append(
            f"{lost:,} committed rows lost records and run again; {len(rows):,} intact rows stay "
            "committed"
        )
    return s.notes


def _committed_lines(out: Path, f: ShardFile) -> tuple[list[bytes], bool]:
    """The whole lines (without newlines) of a file's committed bytes still on disk, and whether
    any committed byte is gone."""
    path = out / f.path
    if not path.is_file():
        return [], True
    size = path.stat().st_size
    length = size if f.bytes is None else f.bytes
    with open(path, "rb") as fh:
        data = fh.read(min(size, length))
    lines = data.split(b"\n")
    lines.pop()  # after the last newline: nothing, or a line cut in two
    return lines, size < length or len(lines) != f.rows


def _record(raw: bytes) -> _Record | None:
    try:
        return _decode(raw)
    except msgspec.DecodeError:
        return None


def _describe_loss(out: Path, f: ShardFile, left: int) -> str:
    path = out / f.path
    if not path.is_file():
        return f"{f.path}: missing; its {f.rows:,} committed lines are gone"
    return f"{f.path}: {left:,} of its {f.rows:,} committed lines are left"


def _no_rows(out: Path, f: ShardFile) -> RunError:
    return RunError(
        f"cannot resume {out}: committed records are gone and the records of {f.path} carry no "
        "input row number (OpenAI Batch output), so the rows that lost them cannot be told "
        "apart: put the files back as the manifest lists them, or pass --overwrite to run "
        "every row again"
    )
