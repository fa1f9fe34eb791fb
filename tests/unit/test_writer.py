"""Records, sharded atomic writer and manifest."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pyarrow.json as pa_json
import pytest

from batchrun.io.manifest import Counts, InputInfo, Manifest, read_manifest, utc_now, write_manifest
from batchrun.io.readers import RawRow, open_dataset
from batchrun.io.records import (
    Completion,
    encode_line,
    error_record,
    openai_error_record,
    openai_result_record,
    result_records,
)
from batchrun.io.rows import PreparedRow, RowError, RowSpec, prepare_row
from batchrun.io.writer import ShardedWriter, ShardFile, write_json_atomic
from batchrun.params import SamplingParams, TopLogprobs


def make_prepared(data: dict, row: int = 0, openai: bool = False, **params) -> PreparedRow:
    p = prepare_row(RawRow(row, data, None), RowSpec(), SamplingParams(**params), openai)
    assert isinstance(p, PreparedRow), p
    return p


def make_completion(index: int = 0, text: str = "hi there", **kw) -> Completion:
    fields = dict(
        index=index,
        text=text,
        token_ids=[5, 6],
        finish_reason="stop",
        prompt_tokens=10,
        completion_tokens=2,
        cached_tokens=4,
    )
    return Completion(**{**fields, **kw})


def decode(line: bytes) -> dict:
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    return json.loads(line)


def test_result_record_fields_and_order() -> None:
    p = make_prepared({"prompt": "x"}, row=7)
    (rec,) = result_records(p, [make_completion(latency_s=0.123456)])
    line = encode_line(rec)
    assert list(decode(line)) == ["id", "text", "finish_reason", "usage", "row", "latency_s"]
    assert decode(line) == {
        "id": "7",
        "text": "hi there",
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 10, "completion_tokens": 2, "cached_tokens": 4},
        "row": 7,
        "latency_s": 0.1235,
    }
    (rec,) = result_records(p, [make_completion()], with_row=False, with_token_ids=True)
    assert decode(encode_line(rec))["token_ids"] == [5, 6] and "row" not in decode(encode_line(rec))


def test_result_records_n_and_logprobs() -> None:
    p = make_prepared({"prompt": "x", "n": 2}, row=0)
    top = [TopLogprobs([5, 9], [-0.1, -2.5]), TopLogprobs([6, 1], [-0.2, -3.0])]
    comps = [
        make_completion(1, "b"),
        make_completion(0, "a", logprobs=[-0.1, -0.2], top_logprobs=top),
    ]
    recs = [decode(encode_line(r)) for r in result_records(p, comps)]
    assert [(r["index"], r["text"]) for r in recs] == [(0, "a"), (1, "b")]
    assert recs[0]["row"] == 0  # row 0 is kept, not omitted as a default
    assert recs[0]["logprobs"][0] == {
        "token_id": 5,
        "logprob": -0.1,
        "top": [{"token_id": 5, "logprob": -0.1}, {"token_id": 9, "logprob": -2.5}],
    }
    assert "logprobs" not in recs[1]
    # with the token texts (the runner's TokenTexts)
    recs = [decode(encode_line(r)) for r in result_records(p, comps, token_text=lambda t: f"<{t}>")]
    assert recs[0]["logprobs"][1] == {
        "token_id": 6,
        "token": "<6>",
        "logprob": -0.2,
        "top": [
            {"token_id": 6, "token": "<6>", "logprob": -0.2},
            {"token_id": 1, "token": "<1>", "logprob": -3.0},
        ],
    }


def test_error_records() -> None:
    err = RowError("abc", 4, "invalid_request", "row 4: 'prompt' is empty")
    assert decode(encode_line(error_record(err))) == {
        "id": "abc",
        "row": 4,
        "error": {"type": "invalid_request", "message": "row 4: 'prompt' is empty"},
    }
    rec = decode(encode_line(openai_error_record(err)))
    assert list(rec) == ["id", "custom_id", "response", "error"]
    assert rec["id"].startswith("batch_req_") and rec["custom_id"] == "abc"
    assert rec["response"] is None
    assert rec["error"] == {"code": "invalid_request", "message": "row 4: 'prompt' is empty"}


def test_kept_input_columns_go_under_input() -> None:
    kept = {"id": "from the input", "text": None, "meta": {"k": [1]}}
    p = make_prepared({"prompt": "x"}, row=2)._replace(kept=kept)
    (rec,) = result_records(p, [make_completion()], with_timing=False)
    out = decode(encode_line(rec))
    assert list(out) == ["id", "text", "finish_reason", "usage", "row", "input"]
    assert out["id"] == "2" and out["text"] == "hi there" and out["input"] == kept
    err = RowError("q", 4, "invalid_request", "row 4: no prompt", kept)
    assert decode(encode_line(error_record(err))) == {
        "id": "q",
        "row": 4,
        "error": {"type": "invalid_request", "message": "row 4: no prompt"},
        "input": kept,
    }


def test_openai_chat_output_field_by_field() -> None:
    line = {
        "custom_id": "req-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}], "n": 2},
    }
    p = make_prepared(line, openai=True)
    comps = [
        make_completion(0, "a", prompt_tokens=10, cached_tokens=0, completion_tokens=3),
        make_completion(
            1, "b", prompt_tokens=10, cached_tokens=9, completion_tokens=5, finish_reason="length"
        ),
    ]
    rec = decode(encode_line(openai_result_record(p, comps, model="local-model", created=123)))
    assert list(rec) == ["id", "custom_id", "response", "error"]
    assert rec["id"].startswith("batch_req_") and rec["custom_id"] == "req-1"
    assert rec["error"] is None
    resp = rec["response"]
    assert resp["status_code"] == 200 and isinstance(resp["request_id"], str)
    body = resp["body"]
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["created"] == 123 and body["model"] == "local-model"
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "stop"},
        {"index": 1, "message": {"role": "assistant", "content": "b"}, "finish_reason": "length"},
    ]
    assert body["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 8,
        "total_tokens": 18,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_openai_completions_output_with_logprobs() -> None:
    line = {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "m", "prompt": "hi", "logprobs": 1},
    }
    p = make_prepared(line, openai=True)
    comp = make_completion(
        logprobs=[-0.1, -0.2], top_logprobs=[TopLogprobs([5], [-0.1]), TopLogprobs([6], [-0.2])]
    )
    rec = decode(encode_line(openai_result_record(p, [comp], model="m", token_str=str)))
    body = rec["response"]["body"]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == "hi there" and choice["index"] == 0
    assert choice["logprobs"] == {
        "tokens": ["5", "6"],
        "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{"5": -0.1}, {"6": -0.2}],
    }


def test_sharded_writer_rotates_on_commit_and_reads_back(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "run"
    prepared = [make_prepared({"prompt": f"p{i}"}, row=i) for i in range(25)]
    writer = ShardedWriter(out, "results", shard_size=10)
    for p in prepared:
        for rec in result_records(p, [make_completion(text=f"t{p.row}")]):
            writer.add(encode_line(rec))
        if p.row % 7 == 6:
            writer.commit()  # commits do not follow shard boundaries
    assert writer.num_buffered == 4 and writer.num_written == 21
    assert writer.commit() is False  # no new file: the last one had room
    writer.close()
    assert [(f.path, f.rows) for f in writer.files] == [
        ("results-00000.jsonl", 10),
        ("results-00001.jsonl", 10),
        ("results-00002.jsonl", 5),
    ]
    for f in writer.files:
        assert f.bytes == (out / f.path).stat().st_size
    files = [str(out / f.path) for f in writer.files]
    ds = datasets.load_dataset("json", data_files=files, split="train")
    assert sorted(ds["row"]) == list(range(25)) and ds[0]["usage"]["cached_tokens"] == 4
    table = pa_json.read_json(files[0])
    assert table.num_rows == 10 and table.column("text").to_pylist()[:2] == ["t0", "t1"]
    # Every row exactly once across shards.
    ids = [json.loads(x)["id"] for f in files for x in Path(f).read_text().splitlines()]
    assert sorted(ids, key=int) == [str(i) for i in range(25)]


def test_writer_resume_continues_last_shard_and_empty_commit(tmp_path: Path) -> None:
    w = ShardedWriter(tmp_path, "errors", shard_size=3)
    assert w.commit() is False and w.files == []  # nothing buffered: no empty file
    for _ in range(2):
        w.add(b'{"a":1}\n')
    assert w.commit() is True
    w.close()
    again = ShardedWriter(tmp_path, "errors", shard_size=3, files=w.files)
    assert again.repair() == []
    for _ in range(2):
        again.add(b'{"b":2}\n')
    again.commit()
    assert [(f.path, f.rows) for f in again.files] == [
        ("errors-00000.jsonl", 3),
        ("errors-00001.jsonl", 1),
    ]
    with pytest.raises(ValueError):
        ShardedWriter(tmp_path, "x", shard_size=0)


def test_manifest_round_trip(tmp_path: Path) -> None:
    m = Manifest(
        created=utc_now(),
        model="/models/tiny",
        input=InputInfo("in.jsonl", "jsonl"),
        config={"max_tokens": 16, "shard_size": 10},
    )
    write_manifest(tmp_path, m)
    assert read_manifest(tmp_path) == m and read_manifest(tmp_path / "none") is None
    m.files.append(ShardFile("results-00000.jsonl", 10))
    m.counts = Counts(rows_total=11, rows_ok=10, rows_failed=1, completions=10)
    m.status, m.finished = "complete", utc_now()
    write_manifest(tmp_path, m)
    raw = json.loads((tmp_path / "manifest.json").read_text())
    assert raw["status"] == "complete" and raw["batchrun_version"]
    assert raw["files"] == [{"path": "results-00000.jsonl", "rows": 10}]
    assert raw["counts"]["rows_failed"] == 1 and raw["input"]["format"] == "jsonl"
    assert read_manifest(tmp_path).is_complete
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(ValueError, match="damaged"):
        read_manifest(tmp_path)


def test_write_json_atomic_plain_dict(tmp_path: Path) -> None:
    write_json_atomic(tmp_path / "x.json", {"a": [1, 2]})
    assert msgspec.json.decode((tmp_path / "x.json").read_bytes()) == {"a": [1, 2]}


def test_every_row_accounted_for_once(tmp_path: Path) -> None:
    lines = [
        '{"prompt": "a"}',
        "{oops",
        "",
        '{"prompt": 3}',
        "[1]",
        '{"messages": [{"role": "user", "content": "hi"}]}',
        '{"text": "no prompt"}',
        '{"prompt": "b", "max_tokens": "x"}',
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    results = ShardedWriter(tmp_path / "out", "results", shard_size=2)
    errors = ShardedWriter(tmp_path / "out", "errors", shard_size=2)
    for batch in open_dataset(tmp_path / "in.jsonl").iter_batches(3):
        for raw in batch:
            p = prepare_row(raw, RowSpec(), SamplingParams(), openai=False)
            if isinstance(p, RowError):
                errors.add(encode_line(error_record(p)))
            else:
                for rec in result_records(p, [make_completion()]):
                    results.add(encode_line(rec))
    results.commit()
    errors.commit()
    read = lambda w: [json.loads(x) for f in w.files for x in (w.out_dir / f.path).open()]
    ok, bad = read(results), read(errors)
    assert sorted(r["row"] for r in ok) == [0, 5]
    assert sorted(r["row"] for r in bad) == [1, 3, 4, 6, 7]  # line 3 is blank: skipped
    assert all(r["error"]["message"].startswith(("line", "row")) for r in bad)
