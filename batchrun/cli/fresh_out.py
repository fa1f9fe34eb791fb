"""The --out directories a `submit` makes, removed again when its start fails before anything
is committed: a failed start leaves the disk as it found it."""

from __future__ import annotations

import shutil
from pathlib import Path

from batchrun.io.manifest import read_manifest


class FreshOut:
    """Notes which of `out` and its parents do not exist yet (before the run makes them)."""

    def __init__(self, out: str | Path):
        out = Path(out).absolute()
        missing = [p for p in (out, *out.parents) if not p.exists()]
        self.top = missing[-1] if missing else None  # the outermost directory the run makes

    def discard_if_uncommitted(self) -> None:
        """Remove the directories this run made, unless a manifest there commits a row."""
        if self.top is None or not self.top.is_dir():
            return
        for manifest in self.top.rglob("manifest.json"):
            try:
                m = read_manifest(manifest.parent)
            except ValueError:
                return  # not ours to judge: keep it
            if m is not None and m.ledger_rows > 0:
                return
        shutil.rmtree(self.top, ignore_errors=True)
