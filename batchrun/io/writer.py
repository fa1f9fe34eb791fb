"""Sharded, append-only JSONL output with a commit record.

Records are buffered in memory and committed in batches (every --commit-every rows or
--commit-interval seconds): ``commit()`` appends the buffered lines to the current shard file
(``results-00000.jsonl``, rotated every ``shard_size`` records), fsyncs it, and updates the
shard's committed ``rows`` and ``bytes``. The caller then rewrites ``manifest.json`` atomically:
that rewrite IS the commit. A crash between the append and the manifest leaves bytes past the
committed length (possibly a torn last line); ``repair()`` on resume truncates every listed
file to its committed length and deletes shard files the manifest never listed, so only
committed records survive and the rows behind the dropped tail run again.

    file on disk:   | committed (manifest: rows, bytes) | appended, not yet committed |
                    0                                 bytes                     size

A shard of a finished run is exactly its committed bytes. Memory is bounded by one commit's
worth of encoded lines. ``RowLedger`` keeps the committed input rows (uint64 row numbers, in
commit order) with the same protocol: resume and ``batchrun merge`` read it instead of parsing
the records.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Any

import msgspec
import numpy as np


class ShardFile(msgspec.Struct, omit_defaults=True):
    path: str  # relative to the output directory
    rows: int  # committed records (lines)
    bytes: int | None = None  # committed length; None in manifests of batchrun < 0.2 (whole file)


class DamagedRunError(Exception):
    """A listed file is missing or shorter than its committed length: the run cannot resume."""


def fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry is; not possible on Windows.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """os.write until every byte is written (a write may be short, e.g. near a full disk)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.EIO, "write returned no progress")
        view = view[n:]


def write_bytes_atomic(path: str | Path, data: bytes | bytearray | memoryview) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """msgspec-encodable object (Struct, dict, ...) as indented JSON, atomically."""
    data = msgspec.json.format(msgspec.json.encode(obj), indent=2) + b"\n"
    write_bytes_atomic(path, data)


def committed_bytes(path: Path, shard: ShardFile) -> int:
    return shard.bytes if shard.bytes is not None else path.stat().st_size


def _truncate(path: Path, length: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, length)
        try:
            os.fsync(fd)
        except OSError:
            pass  # NOTE: not needed for correctness: the manifest's lengths rule, not the size
    finally:
        os.close(fd)


class ShardedWriter:
    """Buffers encoded JSONL lines; ``commit()`` appends them to ``{prefix}-{NNNNN}.jsonl``.

    ``files`` lists the shards with their committed rows and bytes (what the manifest records).
    A resumed writer gets the manifest's list and calls ``repair()`` before adding anything.
    """

    def __init__(
        self,
        out_dir: str | Path,
        prefix: str,
        shard_size: int = 10_000,
        files: list[ShardFile] | None = None,
    ) -> None:
        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.shard_size = shard_size
        self.files: list[ShardFile] = [ShardFile(f.path, f.rows, f.bytes) for f in files or []]
        self._lines: list[bytes] = []
        self._fd: int | None = None  # open append descriptor of files[-1]

    @property
    def num_buffered(self) -> int:
        return len(self._lines)

    @property
    def num_written(self) -> int:
        return sum(f.rows for f in self.files)

    def _name(self, index: int) -> str:
        return f"{self.prefix}-{index:05d}.jsonl"

    def repair(self) -> list[str]:
        """Make the directory match ``files``: truncate uncommitted tails, delete unlisted shard
        files and temp files. Returns what was repaired (for a message); raises DamagedRunError
        when a listed file is missing or shorter than committed."""
        notes = []
        listed = set()
        for f in self.files:
            path = self.out_dir / f.path
            listed.add(f.path)
            if not path.is_file():
                raise DamagedRunError(f"{path} is listed in the manifest but missing")
            size = path.stat().st_size
            length = committed_bytes(path, f)
            f.bytes = length
            if size < length:
                raise DamagedRunError(
                    f"{path} holds {size} bytes but {length} were committed: the file was "
                    "truncated or replaced outside batchrun"
                )
            if size > length:
                _truncate(path, length)
                notes.append(f"{f.path}: dropped {size - length} uncommitted bytes")
        pattern = re.compile(rf"^{re.escape(self.prefix)}-\d+\.jsonl$")
        for p in sorted(self.out_dir.iterdir()):
            if pattern.match(p.name) and p.name not in listed:
                p.unlink()
                notes.append(f"{p.name}: removed (never committed)")
            elif p.name.startswith(f".{self.prefix}-") and p.name.endswith(".tmp"):
                p.unlink()
        return notes

    def add(self, record: bytes) -> None:
        """Buffer one encoded line (ending in b"\\n") until the next commit."""
        self._lines.append(record)

    def commit(self) -> bool:
        """Append the buffered lines to the shard files and fsync them. Returns whether a new
        shard file was created (its directory entry must be made durable before the manifest
        names it: the caller's fsync_dir). On an OSError nothing of this commit counts: the
        shards' committed lengths are unchanged and the appended bytes are cut off again."""
        if not self._lines:
            return False
        created = False
        lines, self._lines = self._lines, []
        staged = [(f.rows, f.bytes) for f in self.files]
        num_files = len(self.files)
        try:
            while lines:
                if not self.files or self.files[-1].rows >= self.shard_size:
                    self._close_fd()
                    index = _index(self.files[-1].path) + 1 if self.files else 0
                    name = self._name(index)
                    self.files.append(ShardFile(name, 0, 0))
                    created = True
                shard = self.files[-1]
                take = lines[: self.shard_size - shard.rows]
                lines = lines[len(take) :]
                data = b"".join(take)
                fd = self._open(shard)
                write_all(fd, data)
                os.fsync(fd)
                shard.rows += len(take)
                shard.bytes = (shard.bytes or 0) + len(data)
        except OSError:
            self._rollback(staged, num_files)
            raise
        return created

    def _open(self, shard: ShardFile) -> int:
        if self._fd is None:
            path = self.out_dir / shard.path
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        return self._fd

    def _rollback(self, staged: list[tuple[int, int | None]], num_files: int) -> None:
        self._close_fd()
        for f in self.files[num_files:]:
            (self.out_dir / f.path).unlink(missing_ok=True)
        del self.files[num_files:]
        for f, (rows, length) in zip(self.files, staged):
            f.rows, f.bytes = rows, length
            try:  # best effort: the next resume truncates anyway
                path = self.out_dir / f.path
                if length is not None and path.stat().st_size > length:
                    _truncate(path, length)
            except OSError:
                pass

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        """Drop the descriptor; buffered (uncommitted) lines are discarded: commit() first."""
        self._close_fd()
        self._lines = []


def _index(name: str) -> int:
    return int(name.rsplit("-", 1)[1].split(".", 1)[0])


class RowLedger:
    """Committed input rows as uint64 little-endian row numbers, appended at each commit; the
    manifest's ``ledger_rows`` is the committed count (anything past it is cut on resume)."""

    NAME = "rows-committed.bin"
    DTYPE = np.dtype("<u8")

    def __init__(self, out_dir: str | Path, committed: int = 0) -> None:
        self.path = Path(out_dir) / self.NAME
        self.committed = committed
        self._pending: list[int] = []

    def repair(self) -> np.ndarray:
        """Truncate to the committed count; returns the committed row numbers."""
        self.truncate()
        return read_ledger(self.path.parent, self.committed)

    def truncate(self) -> None:
        want = self.committed * self.DTYPE.itemsize
        size = self.path.stat().st_size if self.path.exists() else 0
        if size < want:
            raise DamagedRunError(
                f"{self.path} holds {size // self.DTYPE.itemsize} rows but the manifest "
                f"committed {self.committed}"
            )
        if size > want:
            _truncate(self.path, want)

    def add(self, row: int) -> None:
        self._pending.append(row)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def commit(self) -> None:
        if not self._pending:
            return
        data = np.asarray(self._pending, dtype=self.DTYPE).tobytes()
        want = self.committed * self.DTYPE.itemsize
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            write_all(fd, data)
            os.fsync(fd)
        except OSError:
            try:
                os.ftruncate(fd, want)
            except OSError:
                pass
            raise
        finally:
            os.close(fd)
        self.committed += len(self._pending)
        self._pending = []


def read_ledger(out_dir: str | Path, count: int) -> np.ndarray:
    """The first ``count`` committed row numbers of a run directory (uint64)."""
    path = Path(out_dir) / RowLedger.NAME
    if count == 0:
        return np.zeros(0, dtype=RowLedger.DTYPE)
    return np.fromfile(path, dtype=RowLedger.DTYPE, count=count)
