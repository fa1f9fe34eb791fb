"""Structured output on the embedded SmolLM2-135M, CPU, greedy.

One run of 50 JSON-schema rows over 5 schemas, regex rows, choice rows, free rows and an invalid
schema (the Runner, as `batchrun submit` uses it, sharing one engine between runs):

- every schema row that ends with `stop` parses and validates (jsonschema); >= 90 % end so;
- regex and choice rows match;
- the invalid schema is one errors-file record with the compiler's message; the rest run;
- the free rows get exactly the tokens of a run without any constrained row.

Plus the CLI defaults (`--choice`, `--json-schema`, ...) and an OpenAI Batch row's
body.response_format, on a few rows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchrun.cli import main
from batchrun.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.job.config import RunConfig
from batchrun.job.runner import Runner
from batchrun.params import SamplingParams

jsonschema = pytest.importorskip("jsonschema")

MAX_TOKENS = 256

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
        },
        "required": ["name", "age"],
    },
    "sentiment": {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "score": {"type": "integer", "minimum": 0, "maximum": 10},
        },
        "required": ["sentiment", "score"],
    },
    "book": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "author": {"type": "string", "maxLength": 30},
            "year": {"type": "integer"},
        },
        "required": ["title", "author", "year"],
    },
    "city": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "country": {"type": "string", "maxLength": 30},
            "is_capital": {"type": "boolean"},
        },
        "required": ["city", "country", "is_capital"],
    },
    "list": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "string", "maxLength": 20},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["items"],
    },
}
SUBJECTS = {
    "person": [
        "Albert Einstein", "Marie Curie", "a young student", "your grandmother", "a famous singer",
        "Isaac Newton", "a chef from Italy", "a child", "Ada Lovelace", "a football player",
    ],
    "sentiment": [
        "I love this phone!", "The food was cold and bland.", "It is a table.",
        "Best day of my life.", "I want a refund now.", "The movie was okay.",
        "What a wonderful gift!", "The train was late again.", "Water is wet.", "Terrible service.",
    ],
    "book": [
        "a book about the sea", "a classic novel", "a science fiction book", "a children's book",
        "a book about history", "a mystery novel", "a cookbook", "a poetry book",
        "a famous Russian novel", "a book about space",
    ],
    "city": [
        "Paris", "Tokyo", "Sydney", "Toronto", "Berlin", "Rio de Janeiro", "Cairo", "Madrid",
        "New York", "Mumbai",
    ],
    "list": [
        "fruits", "colors", "animals", "planets", "sports", "vegetables", "countries", "tools",
        "musical instruments", "flowers",
    ],
}  # fmt: skip
PROMPTS = {
    "person": "Describe {} as JSON with the fields name and age.",
    "sentiment": 'Classify the sentiment of this review as JSON (sentiment, score 0-10): "{}"',
    "book": "Recommend {} as JSON with the fields title, author and year.",
    "city": "Give facts about the city {} as JSON: city, country, is_capital.",
    "list": "List up to three {} as JSON with the field items.",
}
REGEX_ROWS = {
    "phone": (r"\d{3}-\d{4}", "Write a phone number."),
    "date": (r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", "When did World War II end?"),
    "yesno": (r"(Yes|No), [a-z ]{1,40}\.", "Is the sky blue? Answer and explain briefly."),
}
CHOICE_ROWS = {
    "capital": (["Paris", "London", "Berlin"], "What is the capital of France?"),
    "animal": (["cat", "dog", "fish"], "Which animal barks?"),
    "color": (["red", "green", "blue"], "What color is the sky?"),
}
FREE_ROWS = {
    "free-0": "What is 2 + 2?",
    "free-1": "Name a color.",
    "free-2": "Write one word about the sea.",
}
BAD_SCHEMA = {"type": "object", "properties": {"x": {"type": "strnig"}}}


def _schema_rows() -> list[dict]:
    rows = []
    for name, schema in SCHEMAS.items():
        for i, subject in enumerate(SUBJECTS[name]):
            rf = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
            content = PROMPTS[name].format(subject)
            rows.append({"id": f"{name}-{i}", "prompt": content, "response_format": rf})
    return rows


def _all_rows() -> list[dict]:
    rows = _schema_rows()
    rows += [{"id": k, "prompt": p, "regex": r} for k, (r, p) in REGEX_ROWS.items()]
    rows += [{"id": k, "prompt": p, "choice": c} for k, (c, p) in CHOICE_ROWS.items()]
    rows += [{"id": k, "prompt": p} for k, p in FREE_ROWS.items()]
    bad = {"type": "json_schema", "json_schema": {"schema": BAD_SCHEMA}}
    rows.append({"id": "bad", "prompt": "Anything.", "response_format": bad})
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _read(out: Path, kind: str) -> dict[str, dict]:
    lines = [json.loads(x) for p in out.glob(f"{kind}-*.jsonl") for x in p.read_text().splitlines()]
    return {x.get("custom_id") or x["id"]: x for x in lines}


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model=None, device="cpu", dtype="float32", kv_budget=32768))


def _run(engine: Engine, rows: list[dict], tmp: Path, name: str) -> tuple[dict, dict]:
    out = tmp / name
    config = RunConfig(
        dataset=str(_write_jsonl(tmp / f"{name}.jsonl", rows)),
        out=str(out),
        engine=engine.config,
        defaults=SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.0),
        with_token_ids=True,
        quiet=True,
        handle_signals=False,
    )
    summary = Runner(config, engine=engine).run()
    assert summary.status == "complete"
    engine.check_integrity()
    return _read(out, "results"), _read(out, "errors")


@pytest.fixture(scope="module")
def mixed(engine, tmp_path_factory):
    return _run(engine, _all_rows(), tmp_path_factory.mktemp("mixed"), "mixed")


def test_schema_rows_validate(mixed):
    results, _ = mixed
    stopped = 0
    for name, schema in SCHEMAS.items():
        for i in range(len(SUBJECTS[name])):
            rec = results[f"{name}-{i}"]
            if rec["finish_reason"] != "stop":
                assert rec["finish_reason"] == "length", rec
                continue
            stopped += 1
            value = json.loads(rec["text"])
            jsonschema.validate(value, schema)
    total = sum(len(s) for s in SUBJECTS.values())
    assert total >= 50
    assert stopped >= 0.9 * total, f"only {stopped}/{total} schema rows ended with stop"


def test_regex_and_choice_rows_match(mixed):
    results, _ = mixed
    for key, (pattern, _) in REGEX_ROWS.items():
        rec = results[key]
        assert rec["finish_reason"] == "stop", rec
        assert re.fullmatch(pattern, rec["text"]), rec["text"]
    for key, (choices, _) in CHOICE_ROWS.items():
        rec = results[key]
        assert rec["finish_reason"] == "stop" and rec["text"] in choices, rec


def test_invalid_schema_goes_to_errors(mixed):
    results, errors = mixed
    assert set(errors) == {"bad"}
    message = errors["bad"]["error"]["message"]
    assert "JSON schema" in message and "strnig" in message, message
    assert len(results) == len(_all_rows()) - 1  # every other row ran


def test_free_rows_unchanged_by_constrained_rows(engine, mixed, tmp_path):
    results, _ = mixed
    free_rows = [{"id": k, "prompt": p} for k, p in FREE_ROWS.items()]
    alone, _ = _run(engine, free_rows, tmp_path, "free")
    for key in FREE_ROWS:
        assert results[key]["token_ids"] == alone[key]["token_ids"], key


def test_openai_batch_row(engine, tmp_path):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Is the earth round? Answer in JSON."}],
        "max_tokens": 32,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    line = {"custom_id": "o1", "method": "POST", "url": "/v1/chat/completions", "body": body}
    results, errors = _run(engine, [line], tmp_path, "openai")
    assert not errors
    content = results["o1"]["response"]["body"]["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), schema)


def test_cli_defaults(tmp_path):
    rows = [
        {"id": "a", "prompt": "Is water wet? Answer yes or no."},
        {"id": "b", "prompt": "Is fire cold? Answer yes or no."},
        {"id": "c", "prompt": "Write a three digit number.", "regex": r"\d{3}"},
        {"id": "d", "prompt": "Say hello.", "response_format": {"type": "text"}},
    ]
    data = _write_jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "out"
    args = ["submit", str(data), "--out", str(out), "--device", "cpu", "--temperature", "0"]
    args += ["--max-tokens", "16", "--quiet", "--choice", '["yes", "no"]']
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, (r.output, r.exception)
    results = _read(out, "results")
    assert results["a"]["text"] in ("yes", "no") and results["b"]["text"] in ("yes", "no")
    assert re.fullmatch(r"\d{3}", results["c"]["text"]), results["c"]
    assert results["d"]["text"] not in ("yes", "no")  # {"type": "text"}: the default is off


@pytest.mark.parametrize(
    "args, hint",
    [
        (["--regex", "a("], "--regex"),
        (["--json-schema", "missing.json"], "--json-schema"),
        (["--response-format", "{not json"], "--response-format"),
        (["--choice", "a", "--choice", "b", "--regex", "b"], "one of"),
        (["--choice", "[1, 2]"], "--choice"),
        (["--json-schema", "@BAD"], "strnig"),
    ],
)
def test_cli_rejects_bad_structured_options(args, hint, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(BAD_SCHEMA))
    args = [str(bad) if a == "@BAD" else a for a in args]
    data = _write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "x"}])
    r = CliRunner().invoke(main, ["submit", str(data), "--out", str(tmp_path / "o"), *args])
    assert r.exit_code == 2, r.output
    assert hint in r.output, r.output
