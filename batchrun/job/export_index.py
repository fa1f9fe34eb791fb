"""Where each committed record of a run directory is, by input row: the index `export` sorts.

One pass over the committed bytes of every results and errors file (never past what the
manifest commits) decodes only each line's ``row`` and ``index`` and records where the line
is. The index is five numpy arrays, 28 bytes a record (100M records: 2.8 GB), sorted by
(row, sample index); a record's line is then read back with one ``pread``.

    file 3:  | line | line | line | ... |          file[i] = 3, offset[i], length[i]
                      ^ record i: row[i], index[i]
"""

from __future__ import annotations

import os
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np

from batchrun.io.writer import ShardFile

READ_BYTES = 1 << 22
MAX_OPEN_FILES = 64
CHUNK = 8192  # records read back per numpy gather


class _Key(msgspec.Struct):
    """The fields of a record the index needs; the rest of the line is skipped unparsed."""

    row: int
    index: int = 0
    token_ids: msgspec.Raw = msgspec.Raw()  # left undecoded; empty when the record has none
    logprobs: msgspec.Raw = msgspec.Raw()


_decode_key = msgspec.json.Decoder(_Key).decode


class DamagedRecordError(Exception):
    """A committed line that is not a batchrun record (the run directory is damaged)."""


class RecordIndex:
    def __init__(self, run_dir: Path, files: list[ShardFile]) -> None:
        self.run_dir = run_dir
        self.files = [f for f in files if f.path.startswith(("results-", "errors-"))]
        self.has_index = self.has_token_ids = self.has_logprobs = False
        rows, samples, file_nos = array("q"), array("i"), array("i")
        offsets, lengths = array("q"), array("i")
        for file_no, f in enumerate(self.files):
            for offset, line in _committed_lines(run_dir / f.path, f):
                try:
                    key = _decode_key(line)
                except msgspec.DecodeError as e:
                    raise DamagedRecordError(
                        f"{f.path} at byte {offset}: not a batchrun record with a row ({e})"
                    ) from None
                rows.append(key.row)
                samples.append(key.index)
                file_nos.append(file_no)
                offsets.append(offset)
                lengths.append(len(line))
                self.has_index |= key.index != 0
                self.has_token_ids |= len(key.token_ids) > 0
                self.has_logprobs |= len(key.logprobs) > 0
        self.row = np.frombuffer(rows, dtype=np.int64)
        self.index = np.frombuffer(samples, dtype=np.int32)
        self.file = np.frombuffer(file_nos, dtype=np.int32)
        self.offset = np.frombuffer(offsets, dtype=np.int64)
        self.length = np.frombuffer(lengths, dtype=np.int32)
        self._fds: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self.row)

    def sorted_order(self) -> np.ndarray:
        """Positions of the records by (row, sample index)."""
        return np.lexsort((self.index, self.row))

    def duplicates(self, order: np.ndarray) -> np.ndarray:
        """Rows that have the same (row, sample index) twice (never, in an intact run)."""
        r, i = self.row[order], self.index[order]
        same = (r[1:] == r[:-1]) & (i[1:] == i[:-1])
        return np.unique(r[1:][same])

    def lines(self, order: np.ndarray) -> Iterator[tuple[int, bytes]]:
        """(row, line without its newline) of the records at the positions ``order``, read
        back a chunk of positions at a time."""
        for start in range(0, len(order), CHUNK):
            at = order[start : start + CHUNK]
            columns = (self.row[at], self.file[at], self.length[at], self.offset[at])
            for row, file_no, length, offset in zip(*(c.tolist() for c in columns)):
                yield row, os.pread(self._fd(file_no), length, offset)

    def _fd(self, file_no: int) -> int:
        fd = self._fds.get(file_no)
        if fd is not None:
            self._fds.move_to_end(file_no)
            return fd
        if len(self._fds) >= MAX_OPEN_FILES:
            os.close(self._fds.popitem(last=False)[1])
        fd = os.open(self.run_dir / self.files[file_no].path, os.O_RDONLY)
        self._fds[file_no] = fd
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def committed_lines(run_dir: Path, files: list[ShardFile]) -> Iterator[bytes]:
    """Every committed line of the files, in file order (without newlines)."""
    for f in files:
        for _, line in _committed_lines(run_dir / f.path, f):
            yield line


def _committed_lines(path: Path, f: ShardFile) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of each committed line; bytes past the committed length are not read."""
    left = f.bytes if f.bytes is not None else path.stat().st_size
    offset = 0
    tail = b""
    with open(path, "rb") as fh:
        while left:
            chunk = fh.read(min(left, READ_BYTES))
            if not chunk:
                break
            left -= len(chunk)
            data = tail + chunk
            start = 0
            while (end := data.find(b"\n", start)) >= 0:
                yield offset + start, data[start:end]
                start = end + 1
            offset += start
            tail = data[start:]
