"""``manifest.json``: the commit record of a run directory.

A record counts as written only once the manifest covers it: each listed shard file has its
committed ``rows`` and ``bytes``, ``ledger_rows`` counts the committed input rows (their row
numbers are in ``rows-committed.bin``), ``counts`` sums them. The manifest is rewritten
atomically (temp file, fsync, rename) at every commit; a resumed run truncates everything past
the committed lengths and redoes those rows. ``fingerprint`` pins what the output depends on
(model, input, sampling defaults, row spec, order, shard split, batchrun version): a run only
resumes into a directory with the same fingerprint.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any, Literal

import msgspec

from batchrun import __version__
from batchrun.io.writer import ShardFile, write_json_atomic

MANIFEST_NAME = "manifest.json"


class InputInfo(msgspec.Struct):
    path: str
    format: str  # "jsonl" | "jsonl.gz" | "parquet" | "hf-datasets"
    split: str | None = None


class Counts(msgspec.Struct):
    rows_total: int = 0  # rows read from the input (ok + failed once the run is complete)
    rows_ok: int = 0
    rows_failed: int = 0
    completions: int = 0  # result lines written (n per row)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error_types: dict[str, int] = msgspec.field(default_factory=dict)  # rows_failed by type


class Manifest(msgspec.Struct, kw_only=True):
    batchrun_version: str = __version__
    status: Literal["running", "interrupted", "failed", "complete"] = "running"
    created: str  # ISO 8601, UTC
    finished: str | None = None
    model: str  # name or path as given
    input: InputInfo
    config: dict[str, Any] = msgspec.field(default_factory=dict)
    # the kernels the latest attempt ran (the engine's resolved KernelPlan, field by field)
    kernels: dict[str, Any] = msgspec.field(default_factory=dict)
    counts: Counts = msgspec.field(default_factory=Counts)
    files: list[ShardFile] = msgspec.field(default_factory=list)  # paths relative to the run dir
    ledger_rows: int = 0  # committed input rows (results + errors), see RowLedger
    num_shards: int = 1
    shard_index: int = 0
    fingerprint: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def is_complete(self) -> bool:
        return self.status == "complete"


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def write_manifest(out_dir: str | Path, manifest: Manifest) -> Path:
    path = Path(out_dir) / MANIFEST_NAME
    write_json_atomic(path, manifest)
    return path


def read_manifest(out_dir: str | Path) -> Manifest | None:
    """The manifest of a run directory, or None when there is none yet."""
    path = Path(out_dir) / MANIFEST_NAME
    if not path.exists():
        return None
    try:
        return msgspec.json.decode(path.read_bytes(), type=Manifest)
    except msgspec.DecodeError as e:
        raise ValueError(f"{path} is damaged ({e}); move it away to start the run over") from e
