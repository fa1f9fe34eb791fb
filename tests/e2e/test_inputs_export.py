"""Inputs users have (CSV / TSV, .json arrays, standard input, pre-tokenized rows), records that
keep input columns, and `batchrun export` joining a run back to its input; end to end on the
tiny chat model (CPU)."""

from __future__ import annotations

import csv
import gzip
import io
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_tiny_chat_model  # noqa: E402

from batchrun.cli import main  # noqa: E402

ROWS = [
    {"id": "a", "prompt": "Hello there", "topic": "greet"},
    {"id": "b", "prompt": "What is two\nplus two?", "max_tokens": 5, "topic": "math"},
    {"id": "c", "prompt": "Count to three", "temperature": 0.7, "seed": 5, "n": 2},
    {"id": "d", "prompt": "Stop, here", "max_tokens": 3, "ignore_eos": True, "topic": "x"},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tinychat")
    make_tiny_chat_model(path)
    return str(path)


def invoke(argv: list[str], code: int = 0, input: bytes | None = None):
    result = CliRunner().invoke(main, argv, input=input)
    assert result.exit_code == code, (result.output, result.exception)
    assert "Traceback" not in result.output
    return result


def submit(model: str, dataset, out: Path, *extra: str, code: int = 0, input=None):
    argv = [
        "submit",
        str(dataset),
        "--out",
        str(out),
        "--model",
        model,
        "--device",
        "cpu",
        "--in-process",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--kv-budget",
        "4096",
        "--quiet",
        *extra,
    ]
    return invoke(argv, code, input)


def read_jsonl(out: Path, prefix: str) -> list[dict]:
    return [
        json.loads(line)
        for p in sorted(out.glob(f"{prefix}-*.jsonl"))
        for line in p.read_text().splitlines()
    ]


def by_id(out: Path) -> dict:
    return {
        (r["id"], r.get("index", 0)): (r["text"], r["usage"]) for r in read_jsonl(out, "results")
    }


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_csv(path: Path, rows: list[dict], delimiter: str = ",") -> bytes:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    f = io.StringIO()
    writer = csv.DictWriter(f, columns, delimiter=delimiter, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)  # a missing cell is empty: null
    return f.getvalue().encode()


def test_csv_tsv_and_json_array_run_like_jsonl(model, tmp_path):
    reference = tmp_path / "ref"
    submit(model, write_jsonl(tmp_path / "in.jsonl", ROWS), reference)
    expected = by_id(reference)
    assert len(expected) == 5  # c has n=2
    inputs = {
        "in.csv": write_csv(tmp_path / "in.csv", ROWS),
        "in.tsv.gz": gzip.compress(write_csv(tmp_path / "in.tsv", ROWS, "\t")),
        "in.json": json.dumps(ROWS, indent=2).encode(),
        "in.json.gz": gzip.compress(json.dumps(ROWS).encode()),
    }
    for name, data in inputs.items():
        (tmp_path / name).write_bytes(data)
        out = tmp_path / f"o-{name}"
        submit(model, tmp_path / name, out)
        # per-row fields typed from CSV cells: the same params, so the same greedy text
        assert by_id(out) == expected, name
        assert read_jsonl(out, "errors") == []
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["input"]["format"] == name.removeprefix("in.")


def test_csv_cell_that_does_not_parse_is_a_row_error(model, tmp_path):
    data = "prompt,max_tokens\nfine,4\nnot this,four\n"
    (tmp_path / "in.csv").write_text(data)
    out = tmp_path / "o"
    submit(model, tmp_path / "in.csv", out)
    (err,) = read_jsonl(out, "errors")
    assert err["row"] == 1
    assert err["error"]["message"] == "row 1: 'max_tokens' must be an integer, got str 'four'"
    assert len(read_jsonl(out, "results")) == 1


def test_csv_record_with_wrong_cells_is_an_error_row_and_bad_json_is_refused(model, tmp_path):
    (tmp_path / "in.csv").write_text("prompt,max_tokens\nok,3\na,b,c\nalso ok,2\n")
    out = tmp_path / "o1"
    submit(model, tmp_path / "in.csv", out)
    (err,) = read_jsonl(out, "errors")
    assert err["row"] == 1 and err["error"]["type"] == "invalid_csv"
    assert "record 2 after the header has 3 cells, the header 2" in err["error"]["message"]
    assert len(read_jsonl(out, "results")) == 2
    # a JSON array that does not parse cannot be split into rows: refused before any row runs
    (tmp_path / "bad.json").write_text('[{"prompt": "ok"}, {"prompt": "cut"')
    r = submit(model, tmp_path / "bad.json", tmp_path / "o2", code=3)
    assert "element 1: invalid JSON" in r.output
    assert not list((tmp_path / "o2").glob("results-*"))


def test_prompt_token_ids_run_as_their_text_would(model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    rows = [
        {"id": "text", "prompt": "Hello there"},
        {"id": "ids", "prompt_token_ids": ids, "prompt": "ignored: the ids are the prompt"},
        {"id": "oov", "prompt_token_ids": [1, 2, 260]},
        {"id": "neg", "prompt_token_ids": [1, -2]},
        {"id": "long", "prompt_token_ids": [5] * 1020},
    ]
    out = tmp_path / "o"
    submit(model, write_jsonl(tmp_path / "in.jsonl", rows), out)
    got = by_id(out)
    (ids_text, ids_usage), (text_text, text_usage) = got[("ids", 0)], got[("text", 0)]
    assert ids_text == text_text  # same tokens, same greedy completion
    assert ids_usage["prompt_tokens"] == text_usage["prompt_tokens"] == len(ids)
    assert max(ids_usage["cached_tokens"], text_usage["cached_tokens"]) == len(ids) - 1
    errors = {e["id"]: e["error"] for e in read_jsonl(out, "errors")}
    assert errors["oov"] == {
        "type": "invalid_request",
        "message": "row 2: prompt_token_ids[2] is 260, outside the model's vocabulary (ids 0 "
        "to 259); tokenize with this model's tokenizer",
    }
    assert "prompt_token_ids[1] is -2" in errors["neg"]["message"]
    assert errors["long"]["type"] == "context_length_exceeded"
    r = invoke(["plan", str(tmp_path / "in.jsonl"), "--model", model])
    assert "5: 2 would run, 3 would fail" in r.output


def test_standard_input_is_spooled_fingerprinted_and_resumable(model, tmp_path):
    data = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    out = tmp_path / "o"
    submit(model, "-", out, input=data)
    spooled = out / "stdin.jsonl"
    assert spooled.read_bytes() == data
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["input"]["path"] == str(spooled.absolute())
    assert manifest["fingerprint"]["input"]["stdin"] is True
    assert by_id(out) == by_id_of_file(model, tmp_path, data)
    # the same content again: the same run (already complete); other content: refused
    r = submit(model, "-", out, input=data)
    assert "already complete" in r.output
    r = submit(model, "-", out, input=data[: data.index(b"\n") + 1], code=1)
    assert "different run" in r.output and "input dataset" in r.output
    assert spooled.read_bytes() == data and not list(out.glob(".stdin*"))
    r = submit(model, "-", tmp_path / "empty", input=b"", code=3)
    assert "standard input: the input has no rows" in r.output
    r = invoke(["plan", "-", "--model", model], input=data)
    assert "standard input (jsonl)" in r.output and "4: 4 would run" in r.output


def by_id_of_file(model: str, tmp_path: Path, data: bytes) -> dict:
    (tmp_path / "same.jsonl").write_bytes(data)
    submit(model, tmp_path / "same.jsonl", tmp_path / "same")
    return by_id(tmp_path / "same")


def test_keep_columns_in_results_and_errors(model, tmp_path):
    rows = [
        {"id": "a", "prompt": "Hello", "topic": "greet", "meta": {"src": [1, 2]}},
        {"id": "b", "prompt": "Again", "n": 2},  # no topic, no meta
        {"id": "c", "topic": "broken"},  # no prompt: an error record, with its columns
    ]
    ds = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "o"
    r = submit(model, ds, out, "--keep-columns", "topic,meta", "--keep-columns", "nope")
    assert "warning: --keep-columns: no row has a column 'nope'" in r.output
    results = read_jsonl(out, "results")
    assert {(x["id"], x.get("index", 0)): x["input"] for x in results} == {
        ("a", 0): {"topic": "greet", "meta": {"src": [1, 2]}, "nope": None},
        ("b", 0): {"topic": None, "meta": None, "nope": None},
        ("b", 1): {"topic": None, "meta": None, "nope": None},
    }
    assert results[0]["id"] in ("a", "b")  # the record's own id, never the input's column
    (err,) = read_jsonl(out, "errors")
    assert err["input"] == {"topic": "broken", "meta": None, "nope": None}
    # part of the fingerprint: other columns are another run
    r = submit(model, ds, out, "--keep-columns", "topic", code=1)
    assert "different run" in r.output and "--keep-columns" in r.output
    # a schema that lacks the column: warned before the model loads
    (tmp_path / "in.csv").write_bytes(write_csv(tmp_path / "in.csv", rows[:2]))
    r = submit(model, tmp_path / "in.csv", tmp_path / "o2", "--keep-columns", "topic,typo")
    assert "no row has a column 'typo' (the input's columns: id, prompt, topic, meta, n)" in (
        r.output
    )
    # OpenAI Batch output has a fixed shape: refused, nothing started
    batch = {
        "custom_id": "r1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}]},
    }
    r = submit(
        model,
        write_jsonl(tmp_path / "batch.jsonl", [batch]),
        tmp_path / "o3",
        "--keep-columns",
        "custom_id",
        code=2,
    )
    assert "--keep-columns does not apply to OpenAI Batch input" in r.output
    assert not (tmp_path / "o3" / "manifest.json").exists()
    r = submit(model, ds, tmp_path / "o4", "--keep-columns", "a,,b", code=2)
    assert "empty column name" in r.output


EXPORT_ROWS = [
    {"id": "r0", "prompt": "First question", "gold": 1},
    {"id": "r1", "prompt": "Two samples please", "n": 2, "gold": 2},
    "{not json",
    {"id": "r3", "text": "no prompt column", "gold": 3},
    {"id": "r4", "prompt": "x " * 600, "gold": 4},  # too long for the context
    {"id": "r5", "prompt": "Last one", "gold": 5, "extra": {"k": "v"}},
]


def write_export_input(path: Path) -> Path:
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in EXPORT_ROWS)
    )
    return path


def check_export(records: list[dict], out: Path) -> None:
    """Input order, every committed record once, each with its input row."""
    committed = read_jsonl(out, "results") + read_jsonl(out, "errors")
    assert sorted(json.dumps({k: v for k, v in r.items() if k != "input"}) for r in records) == (
        sorted(json.dumps({k: v for k, v in r.items() if k != "input"}) for r in committed)
    )
    assert [(r["row"], r.get("index", 0)) for r in records] == [
        (0, 0), (1, 0), (1, 1), (2, 0), (3, 0), (4, 0), (5, 0),
    ]  # fmt: skip
    for r in records:
        source = EXPORT_ROWS[r["row"]]
        assert r["input"] == (None if isinstance(source, str) else source)
    assert [r["row"] for r in records if r.get("error")] == [2, 3, 4]


def test_export_jsonl_and_parquet_in_input_order_with_the_input(model, tmp_path):
    ds = write_export_input(tmp_path / "in.jsonl")
    out = tmp_path / "o"
    submit(model, ds, out, "--shard-size", "2", "--keep-columns", "gold")
    r = invoke(["export", str(out), "--format", "jsonl"])
    assert "records      7 (4 results, 3 errors) of 6 input rows; input order" in r.output
    records = [json.loads(x) for x in (out / "export.jsonl").read_text().splitlines()]
    check_export(records, out)
    # Parquet: the same rows; error rows have the error column set, the rest null
    invoke(["export", str(out), "-o", str(tmp_path / "x.parquet")])
    table = pq.read_table(tmp_path / "x.parquet")
    assert table.column_names == [
        "row", "id", "index", "text", "finish_reason", "usage", "error", "input",
    ]  # fmt: skip
    parquet = table.to_pylist()
    assert [(p["row"], p["index"]) for p in parquet] == [
        (r["row"], r.get("index")) for r in records
    ]
    for p, r in zip(parquet, records):
        assert p["text"] == r.get("text") and p["error"] == r.get("error")
        if r["input"] is not None:  # JSON rows' columns: a struct of every column seen
            assert {k: v for k, v in p["input"].items() if v is not None} == r["input"]
    # without the input: the records' own (kept) columns
    invoke(["export", str(out), "--no-input", "-o", str(tmp_path / "n.jsonl")])
    plain = [json.loads(x) for x in (tmp_path / "n.jsonl").read_text().splitlines()]
    assert [x["input"] for x in plain] == [
        {"gold": r["input"]["gold"]} if r["input"] else {"gold": None} for r in records
    ]
    r = invoke(["export", str(out), "--sort", "none"], code=2)
    assert "--no-input" in r.output
    # the input changed since the run: the rows would not match
    ds.write_text(ds.read_text().replace("First", "Frist"))
    r = invoke(["export", str(out)], code=3)
    assert "changed since the run" in r.output and "--no-input" in r.output
    assert not (out / "export.parquet").exists()


def test_export_of_a_sharded_run_reads_merged(model, tmp_path):
    ds = write_export_input(tmp_path / "in.jsonl")
    out = tmp_path / "o"
    for i in range(2):
        submit(model, ds, out, "--num-shards", "2", "--shard-index", str(i))
    r = invoke(["export", str(out)], code=3)
    assert "batchrun merge" in r.output
    r = invoke(["export", str(out / "shard-0"), "--format", "jsonl"])
    assert "input rows have no record here" in r.output
    invoke(["merge", str(out)])
    invoke(["export", str(out), "--format", "jsonl"])
    records = [json.loads(x) for x in (out / "export.jsonl").read_text().splitlines()]
    check_export(records, out / "merged")
