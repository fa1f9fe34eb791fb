"""Every input format streams every row exactly once; bad input gives clear errors."""

from __future__ import annotations

import gzip
import json
import re
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
    (tmp_path / "in.xml").write_text("<rows/>")
    with pytest.raises(BadInputError, match=r"unsupported input file 'in.xml'; supported: .jsonl"):
        open_dataset(tmp_path / "in.xml")
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


# -- JSON arrays ------------------------------------------------------------------------------


def test_json_array_streams_elements_across_reads(tmp_path: Path, monkeypatch) -> None:
    import batchrun.io.json_array as json_array

    # 7-byte reads: every element, number, string and escape is cut somewhere
    monkeypatch.setattr(json_array, "READ_BYTES", 7)
    rows = [
        {"prompt": f'q \u00e9 \\ "{i}"', "max_tokens": 10**12 + i, "x": [1.5, None]}
        for i in range(40)
    ]
    path = tmp_path / "in.json"
    path.write_text("\ufeff [\n" + ",\n".join(json.dumps(r, indent=2) for r in rows) + "\n]\n")
    source = open_dataset(path)
    assert source.format == "json" and source.columns is None
    got = read_all(source, batch_size=6)
    assert [r.data for r in got] == rows and [r.row for r in got] == list(range(40))
    assert source.count_rows() == 40


def test_json_array_non_objects_are_row_errors(tmp_path: Path) -> None:
    path = tmp_path / "in.json.gz"
    path.write_bytes(gzip.compress(b'[{"prompt": "a"}, 7, null, ["x"], {"prompt": "b"}]'))
    rows = read_all(open_dataset(path))
    assert open_dataset(path).format == "json.gz"
    assert rows[0] == RawRow(0, {"prompt": "a"}, None)
    assert [r.error for r in rows[1:4]] == [
        "element 1: expected a JSON object, got int",
        "element 2: expected a JSON object, got null",
        "element 3: expected a JSON object, got list",
    ]
    assert rows[4] == RawRow(4, {"prompt": "b"}, None)
    (tmp_path / "empty.json").write_text(" [ ] ")
    assert read_all(open_dataset(tmp_path / "empty.json")) == []


def test_json_file_of_json_lines_reads_as_jsonl(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.json", ROWS)
    source = open_dataset(path)
    assert source.format == "jsonl" and [r.data for r in read_all(source)] == ROWS


@pytest.mark.parametrize(
    "text, message",
    [
        ('[{"a": 1} {"b": 2}]', "expected ',' or ']' after element 0 at character 10"),
        ('[{"a": 1}, {"b": tru}]', "element 1: invalid JSON"),
        ('[{"a": 1}, {"b": "cut', "element 1: invalid JSON (Unterminated string"),
        ('[{"a": 1}] {"b": 2}', "unexpected data after the array"),
        ('[{"a": 1},', "element 1: invalid JSON"),
    ],
)
def test_json_array_that_does_not_parse_fails_the_input(tmp_path, text, message) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(BadInputError, match=re.escape(message)):
        open_dataset(path).count_rows()


def test_json_array_memory_is_bounded_by_a_row(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    with open(path, "w") as f:
        f.write("[")
        for i in range(200_000):
            f.write(("," if i else "") + json.dumps({"prompt": f"Summarize document {i}. " * 8}))
        f.write("]")
    baseline = peak = _rss_bytes()
    seen = 0
    for batch in open_dataset(path).iter_batches(4096):
        seen += len(batch)
        peak = max(peak, _rss_bytes())
    assert seen == 200_000
    # the file is ~40 MB; as Python dicts ~150 MB: streaming holds one read and one batch
    assert peak - baseline < 100 * 2**20, f"RSS grew by {(peak - baseline) / 2**20:.0f} MiB"


# -- CSV / TSV ---------------------------------------------------------------------------------


def test_csv_reads_text_and_types_the_row_fields(tmp_path: Path) -> None:
    path = tmp_path / "in.csv"
    path.write_text(
        "id,prompt,max_tokens,temperature,stop,ignore_eos,logprobs,prompt_token_ids,code\n"
        '007,"Hello, ""you""\nsecond line",5,0.5,"[""a"", ""b""]",true,3,"[1, 2]",0012\n'
        "8,plain,,,z,0,false,,\n"
        "9,bad,lots,warm,[not json,maybe,,,x\n"
    )
    source = open_dataset(path)
    assert source.format == "csv" and source.num_rows is None
    assert source.columns == [
        "id", "prompt", "max_tokens", "temperature", "stop", "ignore_eos", "logprobs",
        "prompt_token_ids", "code",
    ]  # fmt: skip
    assert source.count_rows() == 3
    rows = read_all(source, batch_size=2)
    assert [r.row for r in rows] == [0, 1, 2]
    assert rows[0].data == {
        "id": "007",  # not a row field: text as written
        "prompt": 'Hello, "you"\nsecond line',
        "max_tokens": 5,
        "temperature": 0.5,
        "stop": ["a", "b"],
        "ignore_eos": True,
        "logprobs": 3,
        "prompt_token_ids": [1, 2],
        "code": "0012",
    }
    # empty cells are null; a string stop is one stop string
    assert rows[1].data["max_tokens"] is None and rows[1].data["stop"] == "z"
    assert rows[1].data["ignore_eos"] is False and rows[1].data["logprobs"] is False
    # a cell that does not parse stays text: the row then fails naming the field and value
    assert rows[2].data["max_tokens"] == "lots" and rows[2].data["stop"] == "[not json"
    err = prepare_row(rows[2], RowSpec(), SamplingParams(), openai=False)
    assert "'max_tokens' must be an integer, got str 'lots'" in err.message
    ok = prepare_row(rows[0], RowSpec(id_column="id"), SamplingParams(), openai=False)
    assert ok.id == "007" and ok.params.max_new_tokens == 5 and ok.params.stop == ("a", "b")
    assert ok.prompt_token_ids == [1, 2]


def test_tsv_gz_and_header_only(tmp_path: Path) -> None:
    path = tmp_path / "in.tsv.gz"
    path.write_bytes(gzip.compress(b"prompt\tn\nsay a, b\t2\n\nnext\t1\n"))
    source = open_dataset(path)
    assert source.format == "tsv.gz"
    assert [r.data for r in read_all(source)] == [
        {"prompt": "say a, b", "n": 2},
        {"prompt": "next", "n": 1},
    ]
    (tmp_path / "head.csv").write_text("prompt,max_tokens\n")
    assert read_all(open_dataset(tmp_path / "head.csv")) == []
    (tmp_path / "empty.csv").write_text("")
    assert open_dataset(tmp_path / "empty.csv").count_rows() == 0


def test_csv_record_with_the_wrong_cell_count_is_a_row_error(tmp_path, monkeypatch) -> None:
    import batchrun.io.csv_source as csv_source

    monkeypatch.setattr(csv_source, "BLOCK_BYTES", 64)  # bad records in many blocks
    lines, bad = [], set()
    for i in range(300):
        if i % 7 == 3:
            lines.append(f"p{i},1,extra")
            bad.add(i)
        elif i % 11 == 5:
            lines.append(f'"multi\nline {i}",2')
        else:
            lines.append(f"p{i},3")
    path = tmp_path / "in.csv"
    path.write_text("prompt,max_tokens\n\n" + "\n".join(lines) + "\nlast\n")
    source = open_dataset(path)
    assert source.count_rows() == 301
    rows = read_all(source, batch_size=16)
    assert [r.row for r in rows] == list(range(301))
    assert {r.row for r in rows if r.data is None} == bad | {300}
    assert rows[3].error == "record 4 after the header has 3 cells, the header 2: 'p3,1,extra'"
    assert rows[300].error.startswith("record 301 after the header has 1 cells")
    assert {r.kind for r in rows if r.data is None} == {"invalid_csv"}
    err = prepare_row(rows[3], RowSpec(), SamplingParams(), openai=False)
    assert (err.type, err.row, err.message) == ("invalid_csv", 3, rows[3].error)
    assert rows[5].data == {"prompt": "multi\nline 5", "max_tokens": 2}
    assert rows[299].data == {"prompt": "p299", "max_tokens": 3}


def test_csv_header_with_a_repeated_name_is_refused(tmp_path: Path) -> None:
    (tmp_path / "dup.csv").write_text("prompt,a,a\nx,1,2\n")
    with pytest.raises(BadInputError, match=r"names columns \['a'\] more than once"):
        open_dataset(tmp_path / "dup.csv")


def test_every_row_field_has_a_csv_cell_type() -> None:
    from batchrun.io.csv_source import CELL_TYPES
    from batchrun.io.row_fields import ROW_PARAM_FIELDS
    from batchrun.io.rows import PROMPT_TOKEN_IDS

    assert set(ROW_PARAM_FIELDS) | {"logprobs", PROMPT_TOKEN_IDS} <= set(CELL_TYPES)
