"""Sharded, atomic JSONL output.

A shard is written in one go when it holds ``shard_size`` records (or on ``close``): temp file
``.{name}.tmp`` → flush → fsync → ``os.replace`` → fsync of the directory. A reader therefore
sees either no file or a complete one, and after a crash only whole shards exist. Memory is
bounded by one shard's encoded bytes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec


class ShardFile(msgspec.Struct):
    path: str  # relative to the output directory
    rows: int


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


def write_bytes_atomic(path: str | Path, data: bytes | bytearray | memoryview) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """msgspec-encodable object (Struct, dict, ...) as indented JSON, atomically."""
    data = msgspec.json.format(msgspec.json.encode(obj), indent=2) + b"\n"
    write_bytes_atomic(path, data)


class ShardedWriter:
    """Buffers encoded JSONL lines and commits them as ``{prefix}-{NNNNN}.jsonl`` shards."""

    def __init__(
        self, out_dir: str | Path, prefix: str, shard_size: int = 10_000, start_index: int = 0
    ) -> None:
        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.shard_size = shard_size
        self.next_index = start_index  # a resumed run starts after the committed shards
        self.files: list[ShardFile] = []
        self._buffer = bytearray()
        self._num_buffered = 0
        # Temp files left by a crashed run hold nothing committed.
        for stale in self.out_dir.glob(f".{prefix}-*.jsonl.tmp"):
            stale.unlink(missing_ok=True)

    @property
    def num_buffered(self) -> int:
        return self._num_buffered

    @property
    def num_written(self) -> int:
        return sum(f.rows for f in self.files)

    def add(self, record: bytes) -> ShardFile | None:
        """Add one encoded line (ending in b"\\n"). Returns the shard it committed, if any."""
        self._buffer += record
        self._num_buffered += 1
        if self._num_buffered >= self.shard_size:
            return self.flush()
        return None

    def add_many(self, records: Iterable[bytes]) -> list[ShardFile]:
        committed = []
        for record in records:
            shard = self.add(record)
            if shard is not None:
                committed.append(shard)
        return committed

    def flush(self) -> ShardFile | None:
        """Commit the buffered records as a (possibly short) shard now."""
        if not self._num_buffered:
            return None
        name = f"{self.prefix}-{self.next_index:05d}.jsonl"
        write_bytes_atomic(self.out_dir / name, self._buffer)
        shard = ShardFile(name, self._num_buffered)
        self.files.append(shard)
        self.next_index += 1
        self._buffer = bytearray()
        self._num_buffered = 0
        return shard

    def close(self) -> ShardFile | None:
        return self.flush()

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
