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


def openai_rows(*bodies: tuple[str, str, dict]) -> list[dict]:
    return [
        {"custom_id": cid, "method": "POST", "url": url, "body": body} for cid, url, body in bodies
    ]


def test_openai_completions_rows_run_as_raw_text(model, tmp_path):
    from transformers import AutoTokenizer

    prompt = "The capital of France is"
    rows = openai_rows(
        ("text", "/v1/completions", {"prompt": prompt, "max_tokens": 3}),
        ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}),
    )
    tok = AutoTokenizer.from_pretrained(model)
    raw = tok(prompt, add_special_tokens=True)["input_ids"]
    templated = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    templated = tok(templated, add_special_tokens=False)["input_ids"]
    assert len(templated) > len(raw)
    ds = write_jsonl(tmp_path / "batch.jsonl", rows)
    for i, extra in enumerate([(), ("--no-chat-template",)]):
        out = tmp_path / f"o{i}"
        submit(model, ds, out, *extra)
        usage = {r["custom_id"]: r["response"]["body"]["usage"] for r in read_jsonl(out, "results")}
        assert usage["text"]["prompt_tokens"] == len(raw)  # the text itself, as a server runs it
        assert usage["chat"]["prompt_tokens"] == len(templated)  # chat rows keep the template


def test_openai_output_names_the_model_that_ran(model, tmp_path):
    asked = "meta-llama/Meta-Llama-3-8B-Instruct"
    rows = openai_rows(
        (
            "chat",
            "/v1/chat/completions",
            {"model": asked, "messages": [{"role": "user", "content": "Hi"}]},
        ),
        ("text", "/v1/completions", {"model": asked, "prompt": "Hi"}),
    )
    ds = write_jsonl(tmp_path / "batch.jsonl", rows)
    for extra, name in [((), Path(model).name), (("--served-model-name", "my-llm"), "my-llm")]:
        out = tmp_path / name
        submit(model, ds, out, *extra)
        results = read_jsonl(out, "results")
        assert [r["response"]["body"]["model"] for r in results] == [name, name]
        assert (
            json.loads((out / "manifest.json").read_text())["config"]["served_model_name"] == name
        )
    # the name is not part of what the output depends on: the complete run is not refused
    r = submit(model, ds, tmp_path / "my-llm", "--served-model-name", "other")
    assert "already complete" in r.output
    r = submit(model, ds, tmp_path / "o", "--served-model-name", " ", code=2)
    assert "--served-model-name" in r.output
    r = CliRunner().invoke(main, ["plan", str(ds), "--model", model, "--served-model-name", "x"])
    assert r.exit_code == 0 and "OpenAI output names it 'x'" in r.output


def test_repeated_ids_fail_after_the_first_row(model, tmp_path):
    rows = [
        {"id": "g1", "prompt": "first"},
        {"id": "g2", "prompt": "second"},
        {"id": "g1", "prompt": "again"},
        {"prompt": "no id"},
        {"id": "g2", "text": "a bad row that repeats an id"},
    ]
    ds = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "o"
    submit(model, ds, out)
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert (counts["rows_total"], counts["rows_ok"], counts["rows_failed"]) == (5, 3, 2)
    assert sorted((r["id"], r["row"]) for r in read_jsonl(out, "results")) == [
        ("3", 3),
        ("g1", 0),
        ("g2", 1),
    ]
    errors = {e["row"]: e for e in read_jsonl(out, "errors")}
    assert sorted(errors) == [2, 4]
    assert errors[2]["id"] == "g1" and errors[2]["error"]["type"] == "duplicate_id"
    assert "id 'g1' repeats row 0" in errors[2]["error"]["message"]
    assert "id 'g2' repeats row 1" in errors[4]["error"]["message"]
    r = CliRunner().invoke(main, ["plan", str(ds), "--model", model])
    assert r.exit_code == 0, r.output
    assert "duplicates   2 rows repeat an earlier row's id" in r.output
    assert "duplicate_id: 2" in r.output


def test_openai_batch_with_repeated_custom_ids_is_refused_before_the_model_loads(model, tmp_path):
    ids = ["a", "b", "a"] + [f"r{i % 12}" for i in range(30)]  # 1 + 18 repeats
    rows = openai_rows(*[(i, "/v1/completions", {"prompt": "x"}) for i in ids])
    ds = write_jsonl(tmp_path / "batch.jsonl", rows)
    out = tmp_path / "o"
    # a model that cannot load: the input is refused first (exit 3, not 4), --out untouched
    r = submit(str(tmp_path / "no-model"), ds, out, code=3)
    assert "unique custom_id" in r.output and "19 request(s) repeat" in r.output
    assert "'a' in rows 0 and 2; 'r0' in rows 3 and 15" in r.output and "and 9 more" in r.output
    assert not out.exists()
    r = CliRunner().invoke(main, ["plan", str(ds), "--model", model])
    assert r.exit_code == 0, r.output
    assert "duplicates   19 requests repeat an earlier custom_id: submit refuses" in r.output
    # --limit: only the rows the run reads count
    submit(model, ds, out, "--limit", "2")
    check_complete(out, 2, 2)


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
    r = submit(model, ds, out)
    check_complete(out, 8, 2)
    # the summary ends with the errors by type and where they are
    assert r.output.splitlines()[-1] == (
        "errors: 3 invalid_request, 2 invalid_json, 1 context_length_exceeded -> "
        f"{out / 'errors-00000.jsonl'}"
    )
    errors = {e["row"]: e for e in read_jsonl(out, "errors")}
    assert set(errors) == {1, 2, 3, 4, 5, 6}
    assert "JSON" in errors[1]["error"]["message"]
    assert "prompt" in errors[2]["error"]["message"]
    assert errors[4]["error"]["type"] == "context_length_exceeded"
    assert "temperature" in errors[6]["error"]["message"]


def test_no_row_can_run_exits_6_with_the_errors_by_type(model, tmp_path):
    """A job where every row fails is not a success: exit 6, the errors by type and their file;
    so is the same run submitted again, and a resumed one whose rows all failed."""
    binary = tmp_path / "binary.jsonl"  # e.g. an archive renamed .jsonl
    binary.write_bytes(bytes(range(256)) * 8)
    out = tmp_path / "o1"
    r = submit(model, binary, out, code=6)
    num = json.loads((out / "manifest.json").read_text())["counts"]["rows_failed"]
    assert num > 1
    assert f"errors: {num} invalid_json -> {out / 'errors-00000.jsonl'}" in r.output
    assert "no row could run" in r.output
    r = submit(model, binary, out, code=6)
    assert "already complete" in r.output and f"errors: {num} invalid_json" in r.output
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert f"errors       {num} invalid_json -> {out / 'errors-00000.jsonl'}" in r.output
    # a resumed run with every row committed (an attempt stopped after its last commit)
    m = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**m, "status": "interrupted"}))
    r = submit(model, binary, out, code=6)
    assert "resuming" in r.output and f"errors: {num} invalid_json" in r.output

    ds = write_jsonl(tmp_path / "in.jsonl", [ROWS[0], ROWS[2]])  # no row sets max_tokens
    r = submit(model, ds, tmp_path / "o3", "--max-tokens", "1000000000", code=6)
    assert "errors: 2 context_length_exceeded" in r.output


def test_empty_input_is_refused_before_the_model_loads(tmp_path):
    """Exit 3, not 4: a model that cannot load is never reached, and --out is left alone."""
    nomodel = str(tmp_path / "nomodel")
    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n\n  \n")):
        (tmp_path / name).write_text(text)
        r = submit(nomodel, tmp_path / name, tmp_path / "o", code=3)
        assert "no rows" in r.output and "nomodel" not in r.output
    pq.write_table(
        pa.Table.from_pylist([], schema=pa.schema([("prompt", pa.string())])),
        tmp_path / "e.parquet",
    )
    r = submit(nomodel, tmp_path / "e.parquet", tmp_path / "o", code=3)
    assert "no rows" in r.output
    assert not (tmp_path / "o").exists()


def test_a_schema_without_a_prompt_or_id_column_is_refused_before_the_model_loads(tmp_path):
    """A CSV or Parquet file's columns are every row's: with no prompt column (or no column
    that --id-column names) no row could run, so submit and plan refuse it (exit 3) and name the
    columns there are; JSON rows, which have no schema, fail one by one instead."""
    nomodel = str(tmp_path / "nomodel")
    pq.write_table(pa.Table.from_pylist([{"question": "hi", "n": 1}] * 3), tmp_path / "q.parquet")
    (tmp_path / "q.csv").write_text("question,n\nhi,1\n")
    for data in (tmp_path / "q.parquet", tmp_path / "q.csv"):
        r = submit(nomodel, data, tmp_path / "o", code=3)
        assert f"{data}: no 'prompt' or 'messages' column: the input's columns are " in r.output
        assert "'question', 'n'; name the prompt's with --prompt-column" in r.output
        r = submit(nomodel, data, tmp_path / "o", "--messages-column", "", code=3)
        assert "no 'prompt' column" in r.output
        r = submit(nomodel, data, tmp_path / "o", "--prompt-column", "question", "--id-column",
                   "uid", code=3)  # fmt: skip
        assert "no id column 'uid': the input's columns are 'question', 'n'" in r.output
        r = CliRunner().invoke(main, ["plan", str(data), "--model", nomodel])
        assert r.exit_code == 3 and "no 'prompt' or 'messages' column" in r.output, r.output
        assert "nomodel" not in r.output  # refused before the model is looked for
    assert not (tmp_path / "o").exists()


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
    assert "--top-p must be in (0, 1], got 1.5" in r.output
    # the option the user wrote, never the field behind it (max_new_tokens, min_new_tokens)
    r = submit(model, ds, tmp_path / "o4", "--max-tokens", "0", code=2)
    assert "--max-tokens must be >= 1, got 0" in r.output and "new_tokens" not in r.output
    r = submit(model, ds, tmp_path / "o4", "--min-tokens", "20", code=2)
    assert "--min-tokens must be between 0 and --max-tokens (12), got 20" in r.output
    r = submit(str(tmp_path / "nomodel"), ds, tmp_path / "o5", code=4)
    assert "nomodel" in r.output
    # unknown column: every row becomes an error naming the column, nothing crashes
    out = tmp_path / "o6"
    submit(model, ds, out, "--prompt-column", "nope", "--messages-column", "", code=6)
    check_complete(out, 1, 0)
    assert "nope" in read_jsonl(out, "errors")[0]["error"]["message"]
    # an existing run is not overwritten by accident: the same run is complete already, a
    # different one is refused
    r = submit(model, ds, out, "--prompt-column", "nope", "--messages-column", "", code=6)
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
    assert "manifest says" in r.output and r.exit_code == 1


def test_damaged_output_is_reported_and_its_rows_run_again(model, tmp_path):
    """A results file cut short after the run completed: inspect exits 1; submit runs the rows
    whose records are gone again (never "already complete") and keeps the intact ones."""
    ds = write_jsonl(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "o"
    submit(model, ds, out, "--shard-size", "2")
    baseline = {(r["id"], r.get("index")): r["text"] for r in read_jsonl(out, "results")}
    shard = out / "results-00001.jsonl"
    intact = out / "results-00000.jsonl"
    before = intact.stat().st_mtime_ns
    shard.write_bytes(shard.read_bytes()[:-7])  # 299 lines where the manifest says 300
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert r.exit_code == 1, r.output
    assert "results-00001.jsonl: 1 lines on disk, manifest says 2" in r.output
    assert "shorter than its committed" in r.output and "batchrun submit" in r.output
    r = submit(model, ds, out, "--shard-size", "2")
    assert "already complete" not in r.output
    assert "results-00001.jsonl: 1 of its 2 committed lines are left" in r.output
    assert "run again" in r.output
    check_complete(out, 5, 5)
    assert {(r["id"], r.get("index")): r["text"] for r in read_jsonl(out, "results")} == baseline
    assert intact.stat().st_mtime_ns == before  # intact committed rows are left alone
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert r.exit_code == 0 and "check        ok" in r.output, r.output


def test_records_are_msgspec_structs_without_defaults(model, tmp_path):
    out = tmp_path / "o"
    submit(model, write_jsonl(tmp_path / "in.jsonl", ROWS[:2]), out)
    for rec in read_jsonl(out, "results"):
        assert "index" not in rec and "token_ids" not in rec and "logprobs" not in rec
    msgspec.json.decode((out / "manifest.json").read_bytes())


PLAIN_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def test_chat_template_option(model, tmp_path):
    """--chat-template FILE renders rows instead of the tokenizer's template (a model without
    one runs messages rows with it); it is part of the resume fingerprint; a file that cannot
    be read or does not compile is exit 2. The byte tokenizer makes prompt tokens = bytes."""
    import shutil

    bare = tmp_path / "bare"  # the tiny model without a chat template
    shutil.copytree(model, bare)
    (bare / "chat_template.jinja").unlink()
    template = tmp_path / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    rows = [
        {"id": "m", "messages": [{"role": "user", "content": "Hi"}]},
        {"id": "p", "prompt": "Hello"},
    ]
    ds = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "o"
    submit(str(bare), ds, out, "--max-tokens", "2")
    errors = read_jsonl(out, "errors")
    assert [e["id"] for e in errors] == ["m"]
    assert "--chat-template FILE" in errors[0]["error"]["message"]

    out = tmp_path / "t"
    submit(str(bare), ds, out, "--max-tokens", "2", "--chat-template", str(template))
    check_complete(out, 2, 2)
    usage = {r["id"]: r["usage"]["prompt_tokens"] for r in read_jsonl(out, "results")}
    assert usage == {"m": len("[user] Hi\n"), "p": len("[user] Hello\n")}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["spec"]["chat_template"] == PLAIN_TEMPLATE
    # the same template resumes (complete); another one is a different run
    r = submit(str(bare), ds, out, "--max-tokens", "2", "--chat-template", str(template))
    assert "already complete" in r.output
    other = tmp_path / "other.jinja"
    other.write_text(PLAIN_TEMPLATE.replace("\n", "\n\n"))
    r = submit(str(bare), ds, out, "--max-tokens", "2", "--chat-template", str(other), code=1)
    assert "different run" in r.output and "--chat-template" in r.output
    # the tokenizer's own template is replaced, for plan too
    r = CliRunner().invoke(main, ["plan", str(ds), "--model", model])
    # ChatML, a special token each: <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n
    assert "prompt tok   total 45 " in r.output, r.output  # 21 + 24 tokens
    r = CliRunner().invoke(
        main, ["plan", str(ds), "--model", model, "--chat-template", str(template)]
    )
    total = sum(usage.values())
    assert f"prompt tok   total {total} " in r.output, r.output

    for path, content, expected in (
        (tmp_path / "missing.jinja", None, "cannot read"),
        (tmp_path / "broken.jinja", "{% for m in messages %}{{ m }}", "does not compile"),
        (tmp_path / "empty.jinja", "  \n", "empty"),
    ):
        if content is not None:
            path.write_text(content)
        for command in ("submit", "plan"):
            args = [command, str(ds), "--model", model, "--chat-template", str(path)]
            if command == "submit":
                args += ["--out", str(tmp_path / "never")]
            r = CliRunner().invoke(main, args)
            assert r.exit_code == 2, (command, r.output)
            assert "--chat-template" in r.output and expected in r.output, r.output
    assert not (tmp_path / "never").exists()


def test_logprobs_carry_token_text(model, tmp_path):
    """Each logprobs entry (and each top entry) has the token's text, as the tokenizer decodes
    it alone (OpenAI's logprobs.content[].token)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    out = tmp_path / "o"
    submit(model, write_jsonl(tmp_path / "in.jsonl", ROWS[:3]), out, "--logprobs", "3")
    records = read_jsonl(out, "results")
    assert records and all(len(r["logprobs"]) == r["usage"]["completion_tokens"] for r in records)
    for r in records:
        for entry in r["logprobs"]:
            assert list(entry) == ["token_id", "token", "logprob", "top"]
            assert entry["token"] == tok.decode([entry["token_id"]])
            assert len(entry["top"]) == 3
            for top in entry["top"]:
                assert list(top) == ["token_id", "token", "logprob"]
                assert top["token"] == tok.decode([top["token_id"]])
