"""`batchrun submit / plan / inspect` end to end on a tiny model: every input format, bad input,
output that reads back with datasets and pyarrow, and every input row accounted for once."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_tiny_chat_model  # noqa: E402

from batchrun.cli import main  # noqa: E402

ROWS = [
    {"id": "a", "prompt": "Hello there"},
    {"id": "b", "prompt": "What is two plus two?", "max_tokens": 5},
    {
        "id": "c",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a color."},
        ],
    },
    {"id": "d", "prompt": "Count to three", "temperature": 0.7, "seed": 5},
    {"id": "e", "prompt": "Stop here", "stop": ["zz"], "n": 2, "temperature": 1.0},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tinychat")
    make_tiny_chat_model(path)
    return str(path)


def submit(model: str, dataset: Path, out: Path, *extra: str, code: int = 0):
    args = [
        "submit",
        str(dataset),
        "--out",
        str(out),
        "--model",
        model,
        "--device",
        "cpu",
        "--max-tokens",
        "12",
        "--temperature",
        "0",
        "--kv-budget",
        "4096",
        "--quiet",
        *extra,
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == code, (result.output, result.exception)
    assert "Traceback" not in result.output
    return result


def read_jsonl(out: Path, prefix: str) -> list[dict]:
    return [
        json.loads(line)
        for p in sorted(out.glob(f"{prefix}-*.jsonl"))
        for line in p.read_text().splitlines()
        if line
    ]


def write_jsonl(path: Path, rows: list, gz: bool = False) -> Path:
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def check_complete(out: Path, num_rows: int, num_ok: int) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    c = manifest["counts"]
    assert (c["rows_total"], c["rows_ok"], c["rows_failed"]) == (
        num_rows,
        num_ok,
        num_rows - num_ok,
    )
    results, errors = read_jsonl(out, "results"), read_jsonl(out, "errors")
    ids_ok = {r["id"] for r in results}
    assert len(ids_ok) + len(errors) == num_rows  # every row exactly once
    assert not ids_ok & {e["id"] for e in errors}
    assert not list(out.glob(".*.tmp"))


def test_jsonl_and_gzip_and_results_shape(model, tmp_path):
    for gz in (False, True):
        ds = write_jsonl(tmp_path / ("in.jsonl.gz" if gz else "in.jsonl"), ROWS, gz)
        out = tmp_path / f"out{gz}"
        submit(model, ds, out, "--shard-size", "2")
        check_complete(out, 5, 5)
        results = read_jsonl(out, "results")
        assert len(results) == 6  # row e has n=2
        assert len(list(out.glob("results-*.jsonl"))) == 3  # shards of 2 records
        by_id = {(r["id"], r.get("index", 0)): r for r in results}
        assert by_id[("b", 0)]["usage"]["completion_tokens"] <= 5
        assert {by_id[("e", 0)]["index"], by_id[("e", 1)]["index"]} == {0, 1}
        for r in results:
            assert set(r) >= {"id", "text", "finish_reason", "usage"}
            assert r["finish_reason"] in ("stop", "length")
            assert "zz" not in r["text"] or r["id"] != "e"


def test_parquet_file_and_directory(model, tmp_path):
    table = pa.Table.from_pylist(
        [{"id": f"r{i}", "prompt": f"Prompt number {i}"} for i in range(7)]
    )
    pq.write_table(table, tmp_path / "one.parquet")
    submit(model, tmp_path / "one.parquet", tmp_path / "o1")
    check_complete(tmp_path / "o1", 7, 7)
    d = tmp_path / "dir"
    d.mkdir()
    pq.write_table(table.slice(0, 3), d / "part-0.parquet")
    pq.write_table(table.slice(3), d / "part-1.parquet")
    submit(model, d, tmp_path / "o2")
    check_complete(tmp_path / "o2", 7, 7)
    first = {r["id"]: r["text"] for r in read_jsonl(tmp_path / "o1", "results")}
    second = {r["id"]: r["text"] for r in read_jsonl(tmp_path / "o2", "results")}
    assert first == second  # greedy, same rows: same text


def test_hf_datasets_directory(model, tmp_path):
    import datasets

    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(
                [{"q": f"question {i}", "key": i} for i in range(4)]
            ),
            "test": datasets.Dataset.from_list([{"q": "only one", "key": 99}]),
        }
    )
    dd.save_to_disk(tmp_path / "hf")
    out = tmp_path / "o"
    submit(
        model, tmp_path / "hf", out, "--split", "test", "--prompt-column", "q", "--id-column", "key"
    )
    check_complete(out, 1, 1)
    assert read_jsonl(out, "results")[0]["id"] == "99"


def test_openai_batch_in_openai_batch_out(model, tmp_path):
    rows = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"Hi {i}"}],
                "max_tokens": 4 + i,
            },
        }
        for i in range(3)
    ] + [{"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": {}}]
    out = tmp_path / "o"
    submit(model, write_jsonl(tmp_path / "batch.jsonl", rows), out)
    results, errors = read_jsonl(out, "results"), read_jsonl(out, "errors")
    assert sorted(r["custom_id"] for r in results) == ["req-0", "req-1", "req-2"]
    for r in results:
        assert r["id"].startswith("batch_req_") and r["error"] is None
        assert r["response"]["status_code"] == 200
        body = r["response"]["body"]
        assert body["object"] == "chat.completion"
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant" and isinstance(
            choice["message"]["content"], str
        )
        u = body["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        assert u["completion_tokens"] <= 4 + int(r["custom_id"][-1])
    assert errors[0]["custom_id"] == "bad" and errors[0]["response"] is None
    assert errors[0]["error"]["message"]


def test_bad_rows_go_to_errors_and_job_goes_on(model, tmp_path):
    lines = [
        json.dumps({"id": "ok1", "prompt": "fine"}),
        "{not json",
        json.dumps({"id": "noprompt", "text": "wrong column"}),
        json.dumps({"id": "wrongtype", "prompt": 42}),
        json.dumps({"id": "toolong", "prompt": "x" * 1100}),
        json.dumps([1, 2]),
        json.dumps({"id": "badparam", "prompt": "hi", "temperature": "hot"}),
        json.dumps({"id": "ok2", "prompt": "also fine"}),
    ]
    ds = tmp_path / "bad.jsonl"
    ds.write_text("\n".join(lines) + "\n")
    out = tmp_path / "o"
    submit(model, ds, out)
    check_complete(out, 8, 2)
    errors = {e["row"]: e for e in read_jsonl(out, "errors")}
    assert set(errors) == {1, 2, 3, 4, 5, 6}
    assert "JSON" in errors[1]["error"]["message"]
    assert "prompt" in errors[2]["error"]["message"]
    assert errors[4]["error"]["type"] == "context_length_exceeded"
    assert "temperature" in errors[6]["error"]["message"]


def test_clear_messages_for_bad_invocations(model, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = submit(model, empty, tmp_path / "o1", code=3)
    assert "no rows" in r.output
    r = submit(model, tmp_path / "missing.jsonl", tmp_path / "o2", code=3)
    assert "missing.jsonl" in r.output
    (tmp_path / "x.xml").write_text("<rows/>")
    r = submit(model, tmp_path / "x.xml", tmp_path / "o3", code=3)
    assert ".jsonl" in r.output and ".csv" in r.output
    ds = write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    r = submit(model, ds, tmp_path / "o4", "--top-p", "1.5", code=2)
    assert "top_p" in r.output
    r = submit(str(tmp_path / "nomodel"), ds, tmp_path / "o5", code=4)
    assert "nomodel" in r.output
    # unknown column: every row becomes an error naming the column, nothing crashes
    out = tmp_path / "o6"
    submit(model, ds, out, "--prompt-column", "nope", "--messages-column", "")
    check_complete(out, 1, 0)
    assert "nope" in read_jsonl(out, "errors")[0]["error"]["message"]
    # an existing run is not overwritten by accident: the same run is complete already, a
    # different one is refused
    r = submit(model, ds, out, "--prompt-column", "nope", "--messages-column", "")
    assert "already complete" in r.output
    r = submit(model, ds, out, code=1)
    assert "different run" in r.output and "--overwrite" in r.output
    submit(model, ds, out, "--overwrite")


def test_output_reads_back_with_datasets_and_pyarrow(model, tmp_path):
    import datasets
    import pyarrow.json as pj

    out = tmp_path / "o"
    submit(model, write_jsonl(tmp_path / "in.jsonl", ROWS), out, "--logprobs", "2", "--token-ids")
    files = sorted(str(p) for p in out.glob("results-*.jsonl"))
    ds = datasets.load_dataset("json", data_files=files, split="train")
    assert ds.num_rows == 6 and "usage" in ds.column_names
    table = pa.concat_tables([pj.read_json(f) for f in files])
    assert table.num_rows == 6
    rec = read_jsonl(out, "results")[0]
    assert len(rec["logprobs"]) == len(rec["token_ids"]) == rec["usage"]["completion_tokens"]
    assert len(rec["logprobs"][0]["top"]) == 2


def test_plan_and_inspect(model, tmp_path):
    ds = write_jsonl(tmp_path / "in.jsonl", ROWS + [{"id": "z"}])
    r = CliRunner().invoke(main, ["plan", str(ds), "--model", model, "--kv-budget", "2048"])
    assert r.exit_code == 0, r.output
    assert "6: 5 would run, 1 would fail" in r.output
    assert "KV need" in r.output and "row 5" in r.output
    out = tmp_path / "o"
    submit(model, ds, out)
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert r.exit_code == 0 and "complete" in r.output and "check        ok" in r.output
    # a damaged run is reported, not trusted
    shard = next(out.glob("results-*.jsonl"))
    shard.write_text(shard.read_text().splitlines()[0] + "\n")
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert "manifest says" in r.output


def test_records_are_msgspec_structs_without_defaults(model, tmp_path):
    out = tmp_path / "o"
    submit(model, write_jsonl(tmp_path / "in.jsonl", ROWS[:2]), out)
    for rec in read_jsonl(out, "results"):
        assert "index" not in rec and "token_ids" not in rec and "logprobs" not in rec
    msgspec.json.decode((out / "manifest.json").read_bytes())
