"""DATASET ``-``: rows on standard input, spooled into the run directory so the run can resume.

Standard input is read once, streamed to ``DIR/.stdin.tmp`` while its content is hashed (the
whole content, not a sample: the fingerprint of a run from ``-``), then renamed to
``DIR/.stdin.jsonl`` (hidden, so a new run directory still counts as empty). Once the run
directory accepts the run (a new run, or the same run resumed: the same fingerprint, so the same
content), the spool becomes ``DIR/stdin.jsonl`` (``stdin.jsonl.gz`` for gzip data,
``stdin.json`` for a JSON array) and the run reads it like any file; ``manifest.json`` names it
as the input, so ``merge`` and ``export`` read it too. A refused run deletes its spool.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import BinaryIO

from batchrun.io.writer import fsync_dir

STDIN = "-"
SPOOL_NAMES = ("stdin.jsonl", "stdin.jsonl.gz", "stdin.json")
SPOOL_TMP = ".stdin.tmp"
_FORMATS = {"stdin.jsonl": "jsonl", "stdin.jsonl.gz": "jsonl.gz", "stdin.json": "json"}
_READ = 1 << 20


class SpooledInput:
    def __init__(self, directory: Path, name: str, size: int, digest: str) -> None:
        self.directory = directory
        self.name = name  # the file it becomes: one of SPOOL_NAMES
        self.tmp = directory / f".{name}"  # until then (readable: the suffix says the format)
        # the fingerprint's "input": the content, whatever file it is spooled to
        self.identity = {"format": _FORMATS[name], "stdin": True, "bytes": size, "digest": digest}

    @property
    def path(self) -> Path:
        return self.directory / self.name

    def keep(self) -> Path:
        """The spool becomes the run's input file (replacing the same content's earlier spool)."""
        os.replace(self.tmp, self.path)
        fsync_dir(self.directory)
        return self.path

    def discard(self) -> None:
        self.tmp.unlink(missing_ok=True)


def spool_stdin(stream: BinaryIO, directory: Path) -> SpooledInput:
    """Copy ``stream`` to ``directory/.stdin.tmp`` (fsynced), hashing it on the way."""
    directory.mkdir(parents=True, exist_ok=True)
    h = hashlib.blake2b(digest_size=16)
    size = 0
    head = b""
    tmp = directory / SPOOL_TMP
    with open(tmp, "wb") as f:
        while chunk := stream.read(_READ):
            h.update(chunk)
            f.write(chunk)
            size += len(chunk)
            if len(head) < 4096:
                head += chunk[:4096]
        f.flush()
        os.fsync(f.fileno())
    if head[:2] == b"\x1f\x8b":
        name = "stdin.jsonl.gz"
    elif head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] == b"[":
        name = "stdin.json"
    else:
        name = "stdin.jsonl"
    spooled = SpooledInput(directory, name, size, h.hexdigest())
    os.replace(tmp, spooled.tmp)
    return spooled


def input_identity_of_spool(path: Path) -> dict:
    """What ``SpooledInput.identity`` was for the spooled file ``path`` (export checks it)."""
    h = hashlib.blake2b(digest_size=16)
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_READ):
            h.update(chunk)
            size += len(chunk)
    return {"format": _FORMATS[path.name], "stdin": True, "bytes": size, "digest": h.hexdigest()}
