"""Vectors on disk: one Parquet file per commit of embeddings (`vectors-00000.parquet`, ...),
columns `id` and `embedding` (a fixed-size list of float32, or float16; the job adds `row`, the
input row number, which export sorts by), written whole and
atomically (a temp file, fsync, rename, the directory fsynced), so a file either holds a commit's
rows or does not exist. `read_vectors` reads them back in the order of a list of ids (export)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.io.writer import fsync_dir

EMBEDDING_DTYPES = {"float32": pa.float32(), "float16": pa.float16()}


def vectors_table(ids: Sequence, vectors: np.ndarray, dtype: str = "float32",
                  rows: Sequence[int] | None = None) -> pa.Table:  # fmt: skip
    """ids [N] and vectors [N, D] -> the table of columns id, embedding (fixed_size_list[D]),
    and row (int64) when `rows` is given."""
    if dtype not in EMBEDDING_DTYPES:
        raise ValueError(f"embedding dtype {dtype!r}; supported: {', '.join(EMBEDDING_DTYPES)}")
    if vectors.ndim != 2 or len(ids) != vectors.shape[0]:
        raise ValueError(f"{len(ids)} ids for vectors of shape {vectors.shape}")
    flat = pa.array(np.ascontiguousarray(vectors, dtype=dtype).reshape(-1))
    embedding = pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])
    columns = {"id": pa.array(list(ids)), "embedding": embedding}
    if rows is not None:
        columns["row"] = pa.array(list(rows), type=pa.int64())
    return pa.table(columns)


def write_vectors(path: str | Path, ids: Sequence, vectors: np.ndarray,
                  dtype: str = "float32", rows: Sequence[int] | None = None) -> None:  # fmt: skip
    """`path` holds exactly these rows once this returns (atomic: temp file, fsync, rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(vectors_table(ids, vectors, dtype, rows), tmp)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_vectors(paths: Sequence[str | Path], order: Sequence | None = None) -> pa.Table:
    """The shards' rows as one table, in the order of the ids `order` (as stored if None);
    KeyError names an id of `order` that no shard holds."""
    table = pa.concat_tables([pq.read_table(p) for p in paths])
    if order is None:
        return table
    where = {v: i for i, v in enumerate(table.column("id").to_pylist())}
    missing = [i for i in order if i not in where]
    if missing:
        raise KeyError(f"{len(missing)} ids have no vector, e.g. {missing[:3]}")
    return table.take(pa.array([where[i] for i in order], type=pa.int64()))
