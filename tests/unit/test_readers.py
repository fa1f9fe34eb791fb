"""Every input format streams every row exactly once; bad input gives clear errors."""

from __future__ import annotations

import gzip
import json
import resource
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.io.readers import BadInputError, RawRow, open_dataset
from batchrun.io.rows import PreparedRow, RowSpec, prepare_row
from batchrun.params import SamplingParams

ROWS = [{"prompt": f"question {i}", "max_tokens": 8 + i} for i in range(10)]


def read_all(source, batch_size: int = 3) -> list[RawRow]:
    return [r for batch in source.iter_batches(batch_size) for r in batch]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl(tmp_path: Path) -> None:
    source = open_dataset(write_jsonl(tmp_path / "in.jsonl", ROWS))
    assert source.format == "jsonl" and source.num_rows is None
    rows = read_all(source)
    assert [r.data for r in rows] == ROWS
    assert [r.row for r in rows] == list(range(10))
    assert source.count_rows() == 10


def test_jsonl_gz_with_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl.gz"
    text = json.dumps(ROWS[0]) + "\n\n   \r\n" + json.dumps(ROWS[1]) + "\r\n"
    with gzip.open(path, "wt") as f:
        f.write(text)
    source = open_dataset(path)
    assert source.format == "jsonl.gz"
    rows = read_all(source)
    # Blank lines are skipped but counted: the second object sits on line 4.
    assert [(r.row, r.data) for r in rows] == [(0, ROWS[0]), (3, ROWS[1])]


def test_jsonl_bad_lines_become_errors(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(
        b'\xef\xbb\xbf{"prompt": "a"}\n{"prompt": \n[1, 2]\n"text"\nnull\n{"prompt": "b"}'
    )
    rows = read_all(open_dataset(path), batch_size=2)
    assert [r.row for r in rows] == [0, 1, 2, 3, 4, 5]
    assert rows[0] == RawRow(0, {"prompt": "a"}, None)
    assert rows[1].data is None and rows[1].error.startswith("line 2: invalid JSON")
    assert rows[2].error == "line 3: expected a JSON object, got list"
    assert rows[3].error == "line 4: expected a JSON object, got str"
    assert rows[4].error == "line 5: expected a JSON object, got null"
    assert rows[5] == RawRow(5, {"prompt": "b"}, None)  # no trailing newline


def test_truncated_gzip_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl.gz"
    data = gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in ROWS * 50))
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(BadInputError, match="truncated or corrupt"):
        read_all(open_dataset(path))


def test_parquet_file(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path, row_group_size=4)
    source = open_dataset(path)
    assert source.format == "parquet" and source.num_rows == 10
    rows = read_all(source, batch_size=3)
    assert [r.data for r in rows] == ROWS and [r.row for r in rows] == list(range(10))


def test_parquet_directory(tmp_path: Path) -> None:
    d = tmp_path / "parts"
    d.mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS[:6]), d / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[6:]), d / "part-1.parquet")
    (d / "_SUCCESS").write_text("")
    source = open_dataset(d)
    assert source.num_rows == 10
    rows = read_all(source, batch_size=4)
    assert [r.data for r in rows] == ROWS and [r.row for r in rows] == list(range(10))


def test_datasets_dir_and_object(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "ds"))
    source = open_dataset(tmp_path / "ds")
    assert source.format == "hf-datasets" and source.num_rows == 10
    assert [r.data for r in read_all(source)] == ROWS
    assert [r.data for r in read_all(open_dataset(ds))] == ROWS


def test_datasets_dict_splits(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict(
        {"test": datasets.Dataset.from_list(ROWS[:3]), "val": datasets.Dataset.from_list(ROWS[3:])}
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(BadInputError, match=r"splits \['test', 'val'\].*--split"):
        open_dataset(tmp_path / "dd")
    assert [r.data for r in read_all(open_dataset(tmp_path / "dd", split="val"))] == ROWS[3:]
    with pytest.raises(BadInputError, match="no split 'nope'"):
        open_dataset(tmp_path / "dd", split="nope")
    with_train = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:2]), "x": datasets.Dataset.from_list(ROWS)}
    )
    assert open_dataset(with_train).num_rows == 2  # "train" is the default
    only = datasets.DatasetDict({"eval": datasets.Dataset.from_list(ROWS[:4])})
    assert open_dataset(only).num_rows == 4  # the only split


def test_missing_path_and_unknown_extension(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match="input not found"):
        open_dataset(tmp_path / "nope.jsonl")
    (tmp_path / "in.csv").write_text("prompt\nhi\n")
    with pytest.raises(BadInputError, match=r"unsupported input file 'in.csv'; supported: .jsonl"):
        open_dataset(tmp_path / "in.csv")
    (tmp_path / "in.json").write_text("{}")
    with pytest.raises(BadInputError, match="rename it to .jsonl"):
        open_dataset(tmp_path / "in.json")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(BadInputError, match="without .parquet files"):
        open_dataset(tmp_path / "empty_dir")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(BadInputError, match="not a readable Parquet file"):
        open_dataset(tmp_path / "broken.parquet")


def test_empty_inputs_yield_nothing(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_bytes(b"")
    source = open_dataset(tmp_path / "empty.jsonl")
    assert source.num_rows == 0 and read_all(source) == []
    (tmp_path / "blank.jsonl").write_text("\n\n")
    assert read_all(open_dataset(tmp_path / "blank.jsonl")) == []
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "e.parquet")
    source = open_dataset(tmp_path / "e.parquet")
    assert source.num_rows == 0 and read_all(source) == []


def _rss_bytes() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:  # ru_maxrss is KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_streaming_200k_parquet_rows_keeps_memory_bounded(tmp_path: Path) -> None:
    path = tmp_path / "big.parquet"
    schema = pa.schema([("prompt", pa.string()), ("max_tokens", pa.int64())])
    num_rows, chunk = 200_000, 20_000
    with pq.ParquetWriter(path, schema) as w:
        for start in range(0, num_rows, chunk):
            prompts = [f"Summarize document number {i}. " * 8 for i in range(start, start + chunk)]
            w.write_table(pa.table({"prompt": prompts, "max_tokens": [16] * chunk}, schema=schema))
    baseline = peak = _rss_bytes()
    spec, defaults = RowSpec(), SamplingParams()
    seen = 0
    for batch in open_dataset(path).iter_batches(4096):
        for raw in batch:
            prepared = prepare_row(raw, spec, defaults, openai=False)
            assert isinstance(prepared, PreparedRow) and prepared.row == seen
            seen += 1
        peak = max(peak, _rss_bytes())
    assert seen == num_rows
    # Loading all 200k rows as Python dicts would cost a few hundred MiB; streaming costs one
    # row group. The budget is 2 GiB; assert well under it.
    assert peak - baseline < 512 * 2**20, f"RSS grew by {(peak - baseline) / 2**20:.0f} MiB"
