"""Vector shards: Parquet with id and a fixed-size list embedding (float32 or float16), written
atomically, read back in input order."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.pooling.vector_shard import read_vectors, write_vectors


@pytest.mark.parametrize("dtype,arrow", [("float32", pa.float32()), ("float16", pa.float16())])
def test_shards_hold_fixed_size_lists_and_read_back_in_order(tmp_path, dtype, arrow):
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((10, 6)).astype(np.float32)
    ids = [f"r{i}" for i in range(10)]
    write_vectors(tmp_path / "vectors-00000.parquet", ids[5:], vecs[5:], dtype)
    write_vectors(tmp_path / "vectors-00001.parquet", ids[:5], vecs[:5], dtype)
    assert not list(tmp_path.glob("*.tmp"))
    schema = pq.read_schema(tmp_path / "vectors-00000.parquet")
    assert schema.field("embedding").type == pa.list_(arrow, 6)
    table = read_vectors(sorted(tmp_path.glob("vectors-*.parquet")), order=ids)
    assert table.column("id").to_pylist() == ids
    got = np.array(table.column("embedding").to_pylist(), dtype=np.float32)
    assert np.allclose(got, vecs, atol=1e-3 if dtype == "float16" else 0)
    with pytest.raises(KeyError, match="1 ids have no vector"):
        read_vectors(sorted(tmp_path.glob("vectors-*.parquet")), order=[*ids, "r99"])


def test_bad_dtype_and_shapes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="supported: float32, float16"):
        write_vectors(tmp_path / "v.parquet", ["a"], np.zeros((1, 2)), "int8")
    with pytest.raises(ValueError, match="2 ids for vectors of shape"):
        write_vectors(tmp_path / "v.parquet", ["a", "b"], np.zeros((1, 2)))
