"""`batchrun export` on run directories written by hand: the record index reads only committed
bytes, the join streams, Parquet types come out of mixed JSON rows, and what cannot be exported
says why."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.io.manifest import Counts, InputInfo, Manifest, write_manifest
from batchrun.io.writer import ShardFile
from batchrun.job.export import ExportError, export_run
from batchrun.job.export_index import RecordIndex
from batchrun.job.export_writer import InputTypes
from batchrun.job.resume import input_identity


def make_run(tmp_path: Path, inputs: list[dict], records: dict[str, list[dict]], **kw) -> Path:
    """A run directory with these committed records (plus an uncommitted, torn tail)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in inputs))
    out = tmp_path / "run"
    out.mkdir()
    files = []
    for name, recs in records.items():
        body = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in recs).encode()
        (out / name).write_bytes(body + b'{"id":"torn","ro')  # past the committed length
        files.append(ShardFile(name, len(recs), len(body)))
    manifest = Manifest(
        created="2026-01-01T00:00:00+00:00",
        model="m",
        input=InputInfo(str(data), "jsonl"),
        files=files,
        counts=Counts(),
        fingerprint={"input": input_identity(data, "jsonl", None)},
        **kw,
    )
    write_manifest(out, manifest)
    return out


def result(row: int, index: int | None = None, **kw) -> dict:
    rec = {"id": f"r{row}", "text": f"t{row}.{index}", "finish_reason": "stop"}
    rec["usage"] = {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}
    if index is not None:
        rec["index"] = index
    return {**rec, "row": row, **kw}


def error(row: int) -> dict:
    return {"id": f"r{row}", "row": row, "error": {"type": "invalid_request", "message": "bad"}}


INPUTS = [{"id": f"r{i}", "prompt": f"p{i}", "k": i} for i in range(6)]
RECORDS = {
    # prefix order: rows out of input order, samples of a row apart, across files
    "results-00000.jsonl": [result(4), result(1, 1), result(0, token_ids=[7, 8])],
    "results-00001.jsonl": [result(1, 0), result(5)],
    "errors-00000.jsonl": [error(3)],
}


def read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_index_reads_committed_lines_only(tmp_path):
    out = make_run(tmp_path, INPUTS, RECORDS, status="complete")
    manifest = json.loads((out / "manifest.json").read_text())
    files = [ShardFile(**f) for f in manifest["files"]]
    index = RecordIndex(out, files)
    assert len(index) == 6  # the torn tails are not read
    order = index.sorted_order()
    assert [(int(index.row[i]), int(index.index[i])) for i in order] == [
        (0, 0), (1, 0), (1, 1), (3, 0), (4, 0), (5, 0),
    ]  # fmt: skip
    lines = list(index.lines(order))
    assert [row for row, _ in lines] == [0, 1, 1, 3, 4, 5]
    assert json.loads(lines[2][1]) == result(1, 1) and json.loads(lines[3][1]) == error(3)
    assert index.has_index and index.has_token_ids and not index.has_logprobs
    index.close()


def test_export_joins_in_input_order_and_counts_rows_without_records(tmp_path):
    out = make_run(tmp_path, INPUTS, RECORDS, status="interrupted", ledger_rows=5)
    report = export_run(out, fmt="jsonl")
    rows = read(out / "export.jsonl")
    assert [(r["row"], r.get("index")) for r in rows] == [
        (0, None), (1, 0), (1, 1), (3, None), (4, None), (5, None),
    ]  # fmt: skip
    assert all(r["input"] == INPUTS[r["row"]] for r in rows)
    assert rows[3]["error"] == {"type": "invalid_request", "message": "bad"}
    assert report.rows_without_record == 1  # row 2: not committed
    assert "interrupted: its 5 committed rows are exported" in report.text()
    assert (report.num_results, report.num_errors, report.num_rows) == (5, 1, 5)


def test_parquet_types_of_mixed_json_rows(tmp_path):
    inputs = [
        {"id": "a", "score": 1, "tags": None},
        {"id": "b", "score": 2.5, "tags": ["x"], "new": {"deep": 1}},
        {"id": "c", "score": "high", "tags": []},  # score: int, float and text
    ]
    logprobs = [
        {"token_id": 1, "logprob": -0.5, "top": [{"token_id": 1, "logprob": -0.5}]},
        {"token_id": 2, "logprob": -1.0},
    ]
    with_logprobs = result(2, token_ids=[1, 2], logprobs=logprobs)
    records = {"results-00000.jsonl": [with_logprobs, result(0), result(1)]}
    out = make_run(tmp_path, inputs, records, status="complete")
    export_run(out)
    table = pq.read_table(out / "export.parquet")
    assert table.column_names == [
        "row", "id", "text", "finish_reason", "usage", "token_ids", "logprobs", "error", "input",
    ]  # fmt: skip
    assert table.column("token_ids").to_pylist() == [None, None, [1, 2]]
    assert table.column("logprobs").to_pylist()[2] == [
        {**logprobs[0]},
        {**logprobs[1], "top": None},
    ]
    assert table.schema.field("input").type == pa.struct(
        [
            ("id", pa.string()),
            ("score", pa.string()),  # no one type: JSON text
            ("tags", pa.list_(pa.string())),
            ("new", pa.struct([("deep", pa.int64())])),
        ]
    )
    got = [r["input"] for r in table.to_pylist()]
    assert [g["score"] for g in got] == ["1", "2.5", '"high"']
    assert [g["tags"] for g in got] == [None, ["x"], []]
    assert got[1]["new"] == {"deep": 1} and got[0]["new"] is None
    assert table.column("text").to_pylist() == ["t0.None", "t1.None", "t2.None"]


def test_input_types_unify_across_batches():
    types = InputTypes()
    types.add([{"a": None, "b": 1}])
    types.add([{"a": "x", "b": 2.0}, {"c": [1]}])
    types.add([{"c": [2.5]}, {"b": {"no": 1}}])
    struct, as_json = types.struct()
    assert struct == pa.struct(
        [("a", pa.string()), ("b", pa.string()), ("c", pa.list_(pa.float64()))]
    )
    assert as_json == {"b"}


def test_what_cannot_be_exported_says_why(tmp_path):
    with pytest.raises(ExportError, match="not a directory"):
        export_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="no manifest.json"):
        export_run(tmp_path / "empty")
    out = make_run(tmp_path, INPUTS, RECORDS, status="complete")
    with pytest.raises(ExportError, match="--no-input") as e:
        export_run(out, sort="none")
    assert e.value.exit_code == 2
    report = export_run(out, sort="none", with_input=False, fmt="jsonl")
    assert [r["row"] for r in read(out / "export.jsonl")] == [4, 1, 0, 1, 5, 3]  # file order
    assert "not joined" in report.text()
    # a row committed twice: damaged
    doubled = {**RECORDS, "errors-00000.jsonl": [error(3), error(0)]}
    twice = make_run(tmp_path / "2", INPUTS, doubled, status="complete")
    with pytest.raises(ExportError, match=r"rows committed more than once \(0\)"):
        export_run(twice)
    # a listed file that is gone
    gone = make_run(tmp_path / "4", INPUTS, RECORDS, status="complete")
    (gone / "results-00001.jsonl").unlink()
    with pytest.raises(ExportError, match="is damaged.*results-00001.jsonl") as e:
        export_run(gone)
    assert e.value.exit_code == 1
    # a record for a row the input does not have
    short = make_run(tmp_path / "3", INPUTS, RECORDS, status="complete")
    data = Path(json.loads((short / "manifest.json").read_text())["input"]["path"])
    data.write_text("".join(json.dumps(r) + "\n" for r in INPUTS[:4]))
    with pytest.raises(ExportError, match="changed since the run"):
        export_run(short)
    data.unlink()
    with pytest.raises(ExportError, match="is not there.*--no-input"):
        export_run(short)
    assert not list(short.glob("*export*"))  # nothing half-written


def test_openai_batch_output_is_refused(tmp_path):
    line = {"id": "batch_req_1", "custom_id": "c1", "response": {"status_code": 200}, "error": None}
    out = make_run(tmp_path, INPUTS[:1], {"results-00000.jsonl": [line]}, status="complete")
    with pytest.raises(ExportError, match="OpenAI Batch output.*custom_id"):
        export_run(out)


def test_export_memory_stays_at_the_index(tmp_path):
    """100k records and input rows (~60 MB of JSON, ~300 MB as Python dicts): export holds the
    index (28 bytes a record) and a batch, so the process grows by far less than the run."""
    import threading

    import psutil

    num = 100_000
    inputs = tmp_path / "in.jsonl"
    text = "A long prompt about document {0}. " * 6
    with open(inputs, "w") as f:
        for i in range(num):
            f.write(json.dumps({"id": f"r{i}", "prompt": text.format(i)}) + "\n")
    out = tmp_path / "run"
    out.mkdir()
    files = []
    for k in range(4):  # rows interleaved over the files, as prefix order leaves them
        body = "".join(
            json.dumps(result(i, text=text.format(i)), separators=(",", ":")) + "\n"
            for i in range(k, num, 4)
        ).encode()
        (out / f"results-{k:05d}.jsonl").write_bytes(body)
        files.append(ShardFile(f"results-{k:05d}.jsonl", num // 4, len(body)))
    manifest = Manifest(
        created="2026-01-01T00:00:00+00:00",
        model="m",
        input=InputInfo(str(inputs), "jsonl"),
        files=files,
        status="complete",
        fingerprint={"input": input_identity(inputs, "jsonl", None)},
    )
    write_manifest(out, manifest)
    process = psutil.Process()
    baseline = peak = process.memory_info().rss
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.01):
            peak = max(peak, process.memory_info().rss)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        report = export_run(out, fmt="jsonl")
    finally:
        done.set()
        sampler.join()
    assert report.num_results == num
    grown = (peak - baseline) / 2**20
    assert grown < 32, f"RSS grew by {grown:.0f} MiB"
    with open(out / "export.jsonl") as f:
        first, second = json.loads(next(f)), json.loads(next(f))
    assert (first["row"], second["row"]) == (0, 1) and second["input"]["id"] == "r1"


def test_parquet_input_keeps_its_schema_and_kept_columns_export_without_it(tmp_path):
    out = make_run(tmp_path, INPUTS, RECORDS, status="complete")
    data = tmp_path / "in.parquet"
    table = pa.table(
        {
            "id": [f"r{i}" for i in range(6)],
            "prompt": [f"p{i}" for i in range(6)],
            "k": pa.array(range(6), pa.int16()),
        }
    )
    pq.write_table(table, data)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["input"] = {"path": str(data), "format": "parquet", "split": None}
    manifest["fingerprint"]["input"] = input_identity(data, "parquet", None)
    (out / "manifest.json").write_text(json.dumps(manifest))
    export_run(out)
    got = pq.read_table(out / "export.parquet")
    assert got.schema.field("input").type == pa.struct(list(table.schema))  # int16 stays
    assert got.column("input").to_pylist()[0] == {"id": "r0", "prompt": "p0", "k": 0}
    # without the input, a run with --keep-columns exports the records' own "input"
    kept = {
        "results-00000.jsonl": [result(0, input={"k": 0}), result(1, input={"k": "one"})],
        "errors-00000.jsonl": [{**error(2), "input": {"k": None}}],
    }
    out = make_run(tmp_path / "kept", INPUTS, kept, status="complete")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["config"] = {"spec": {"keep_columns": ["k"]}}
    (out / "manifest.json").write_text(json.dumps(manifest))
    export_run(out, with_input=False)
    got = pq.read_table(out / "export.parquet")
    assert got.column("input").to_pylist() == [{"k": "0"}, {"k": '"one"'}, {"k": None}]
