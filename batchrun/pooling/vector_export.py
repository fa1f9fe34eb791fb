"""`batchrun export OUT` for an embed run: its committed vector files as one Parquet file of
`id` and `embedding`, in input order (the files' `row` column), written to a temp file and
renamed into place. Rows that failed are in the run's errors-*.jsonl, not in this file."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchrun.io.manifest import Manifest

VECTORS_PREFIX = "vectors-"


def vector_files(manifest: Manifest) -> list[str]:
    return [f.path for f in manifest.files if f.path.startswith(VECTORS_PREFIX)]


def export_vectors(run_dir: Path, manifest: Manifest, path: Path) -> int:
    """Write `path`; returns how many vectors it holds."""
    table = pa.concat_tables([pq.read_table(run_dir / f) for f in vector_files(manifest)])
    table = table.take(pc.sort_indices(table, [("row", "ascending")]))
    table = table.select(["id", "embedding"])
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return table.num_rows
