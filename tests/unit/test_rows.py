"""prepare_row (plain and OpenAI Batch rows) and tokenize_rows with a tokenizer built offline."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest

from batchrun.io.readers import RawRow, open_dataset
from batchrun.io.row_structured import structured_from_options
from batchrun.io.rows import (
    PreparedRow,
    RowError,
    RowSpec,
    detect_openai_batch,
    prepare_row,
)
from batchrun.job.tokenize import TokenizedRow, tokenize_rows
from batchrun.params import GrammarSpec, SamplingParams

SPEC = RowSpec()
DEFAULTS = SamplingParams(max_new_tokens=16, temperature=0.0)


def prep(data: dict | None, spec: RowSpec = SPEC, openai: bool = False, row: int = 3):
    return prepare_row(RawRow(row, data, None if data else "line 4: bad"), spec, DEFAULTS, openai)


def test_plain_prompt_row_uses_defaults_and_row_index_id() -> None:
    p = prep({"prompt": "hello", "other": 1})
    assert isinstance(p, PreparedRow)
    assert (p.id, p.row, p.prompt, p.messages, p.openai) == ("3", 3, "hello", None, False)
    assert p.params is DEFAULTS and p.response_format is None and p.extra == {}


def test_per_row_params_override_defaults() -> None:
    p = prep(
        {
            "prompt": "x",
            "max_tokens": 5.0,
            "temperature": 1,
            "top_p": 0.9,
            "top_k": 4,
            "min_p": 0.1,
            "stop": "END",
            "seed": 7,
            "n": 2,
            "logprobs": True,
            "top_logprobs": 3,
            "frequency_penalty": 0.5,
            "presence_penalty": -0.5,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "top_k_unused": None,
        }
    )
    assert isinstance(p, PreparedRow)
    assert p.params == SamplingParams(
        max_new_tokens=5,
        min_new_tokens=2,
        temperature=1.0,
        top_p=0.9,
        top_k=4,
        min_p=0.1,
        repetition_penalty=1.1,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        stop=("END",),
        seed=7,
        n=2,
        logprobs=True,
        top_logprobs=3,
    )
    # Nulls mean "not set" (Parquet rows carry every column).
    assert prep({"prompt": "x", "max_tokens": None, "stop": None}).params is DEFAULTS


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"prompt": 5}, "'prompt' must be a string, got int"),
        ({"prompt": ""}, "'prompt' is empty"),
        ({"messages": "hi"}, "'messages' is a string but not valid JSON"),
        ({"messages": []}, "'messages' is empty"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role must be one of"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content must be a string"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text"),
        (  # a multimodal model's row (Gemma 3): its image refused, the row named
            {"messages": [{"role": "user", "content": [{"type": "image", "url": "a.png"}]}]},
            "messages[0].content: only text parts are supported, got 'image' (batchrun runs "
            "the text model",
        ),
        ({"prompt": "x", "max_tokens": "5"}, "'max_tokens' must be an integer, got str"),
        ({"prompt": "x", "max_tokens": 0}, "'max_tokens' must be >= 1, got 0"),
        ({"prompt": "x", "max_completion_tokens": 0}, "'max_completion_tokens' must be >= 1"),
        ({"prompt": "x", "min_tokens": 20}, "'min_tokens' must be between 0 and the default "),
        ({"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "and 'max_tokens' (2), got 3"),
        ({"prompt": "x", "temperature": -1}, "'temperature' must be >= 0, got -1.0"),
        ({"prompt": "x", "logprobs": True, "top_logprobs": 50}, "'top_logprobs' must be in"),
        ({"prompt": "x", "logprobs": 50}, "'logprobs' must be in [0, 20], got 50"),
        ({"prompt": "x", "stop": [""]}, "'stop': a stop string must not be empty"),
        ({"prompt": None}, "'prompt' is null and it has no 'messages'; give the row a prompt"),
        ({"prompt": None, "messages": None}, "'prompt' and 'messages' are null"),
        ({"prompt": "x", "stop": [1]}, "'stop' must be a string or a list of strings"),
        ({"prompt": "x", "n": True}, "'n' must be an integer, got bool"),
        ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "has both"),
        ({"text": "x", "label": 1}, "row has no 'prompt' or 'messages' column: it has"),
        ({"prompt": "x", "regex": "a+", "choice": ["a"]}, "more than one structured output"),
        ({"prompt": "x", "response_format": {"type": "yaml"}}, "'yaml' is not supported"),
    ],
)
def test_bad_rows_become_row_errors(data: dict, needle: str) -> None:
    err = prep(data)
    assert isinstance(err, RowError), err
    assert (err.id, err.row, err.type) == ("3", 3, "invalid_request")
    assert err.message.startswith("row 3: ") and needle in err.message, err.message


def test_row_messages_name_what_the_row_wrote() -> None:
    """No internal name (max_new_tokens, min_new_tokens) in a row's message, and a null prompt is
    called null, not missing."""
    for data in (
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "x", "min_tokens": 99},
        {"id": "k", "prompt": None},
    ):
        err = prep(data)
        assert isinstance(err, RowError)
        assert "new_tokens" not in err.message and "has ['id']" not in err.message, err.message
    err = prep({"prompt": "x"}, RowSpec(id_column="uid"))
    assert isinstance(err, RowError) and "no value in id column 'uid'" in err.message
    err = prep({"prompt": "x", "uid": None}, RowSpec(id_column="uid"))
    assert isinstance(err, RowError) and "id column 'uid' is null" in err.message


def test_unparsed_row_and_missing_columns_message() -> None:
    assert prep(None) == RowError("3", 3, "invalid_json", "line 4: bad")
    err = prep({"text": "x", "label": 1, "empty": None})
    assert isinstance(err, RowError) and "['text', 'label']" in err.message
    err = prep({"prompt": "x"}, RowSpec(prompt_column="question"))
    assert isinstance(err, RowError)
    assert "row has no 'question' or 'messages' column: it has ['prompt']" in err.message


def test_custom_columns_id_and_system_prompt() -> None:
    spec = RowSpec(prompt_column="q", messages_column="conv", id_column="uid", system_prompt="S")
    p = prep({"q": "hi", "uid": 42}, spec)
    assert isinstance(p, PreparedRow) and (p.id, p.prompt) == ("42", "hi")
    p = prep({"conv": [{"role": "user", "content": "hi", "name": None}], "uid": "a"}, spec)
    assert p.messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    own = [{"role": "system", "content": "mine"}, {"role": "user", "content": "hi"}]
    assert prep({"conv": own, "uid": "b"}, spec).messages == own
    err = prep({"q": "hi"}, spec)
    assert isinstance(err, RowError) and "no value in id column 'uid'" in err.message
    # Turning the messages column off resolves datasets that have both columns.
    p = prep({"prompt": "x", "messages": [1]}, RowSpec(messages_column=None))
    assert isinstance(p, PreparedRow) and p.prompt == "x"


def test_messages_as_json_text_and_content_parts() -> None:
    text = json.dumps([{"role": "user", "content": [{"type": "text", "text": "a"}]}])
    p = prep({"messages": text})
    assert isinstance(p, PreparedRow) and p.messages == [{"role": "user", "content": "a"}]


def test_structured_output_is_kept_for_later() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": json.dumps(schema)}}
    p = prep({"prompt": "x", "response_format": json.dumps(rf)})
    want = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert p.response_format == want
    assert prep({"prompt": "x", "regex": "a+"}).response_format == {"type": "regex", "regex": "a+"}
    assert prep({"prompt": "x", "choice": ["y", "n"]}).response_format["choice"] == ["y", "n"]
    assert prep({"prompt": "x", "ebnf": "root ::= 'a'"}).response_format["type"] == "ebnf"
    assert prep({"prompt": "x", "response_format": {"type": "text"}}).response_format is None


def test_structured_output_becomes_the_params_grammar() -> None:
    schema = {"type": "object", "properties": {"b": {}, "a": {}}}  # key order is kept
    rf = {"type": "json_schema", "json_schema": {"schema": schema}}
    p = prep({"prompt": "x", "response_format": rf, "max_tokens": 5})
    assert p.params.grammar == GrammarSpec("json_schema", json.dumps(schema, separators=(",", ":")))
    assert p.params.max_new_tokens == 5
    assert prep({"prompt": "x", "regex": "a+"}).params.grammar == GrammarSpec("regex", "a+")
    got = prep({"prompt": "x", "choice": ["y", 'n"']}).params.grammar
    assert got == GrammarSpec("choice", '["y","n\\""]')
    assert prep({"prompt": "x", "response_format": {"type": "json_object"}}).params.grammar == (
        GrammarSpec("json_object")
    )
    # a row's format wins over the default; {"type": "text"} turns the default off
    default = msgspec.structs.replace(DEFAULTS, grammar=GrammarSpec("regex", "z"))
    row = RawRow(0, {"prompt": "x", "ebnf": "root ::= 'a'"}, None)
    assert prepare_row(row, SPEC, default, False).params.grammar.kind == "ebnf"
    row = RawRow(0, {"prompt": "x", "response_format": {"type": "text"}}, None)
    assert prepare_row(row, SPEC, default, False).params.grammar is None
    assert prepare_row(RawRow(0, {"prompt": "x"}, None), SPEC, default, False).params is default
    # OpenAI Batch rows: body.response_format
    body = {"messages": [{"role": "user", "content": "q"}], "response_format": rf}
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body}
    assert prep(line, openai=True).params.grammar.kind == "json_schema"


def test_structured_from_options(tmp_path: Path) -> None:
    def opts(rf=None, schema=None, regex=None, choice=(), ebnf=None):
        return structured_from_options(rf, schema, regex, choice, ebnf)

    assert opts() is None
    assert opts(regex="a+") == GrammarSpec("regex", "a+")
    assert (
        opts(choice=("a", "b"))
        == opts(choice=('["a", "b"]',))
        == GrammarSpec("choice", '["a","b"]')
    )
    assert opts(rf='{"type": "json_object"}') == GrammarSpec("json_object")
    path = tmp_path / "s.json"
    path.write_text('{"type": "integer"}')
    assert opts(schema=str(path)) == GrammarSpec("json_schema", '{"type":"integer"}')
    path.write_text('{"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}')
    assert opts(rf=f"@{path}") == GrammarSpec("json_schema", '{"type":"integer"}')
    for kwargs, words in [
        ({"regex": "a", "choice": ("b",)}, "use only one of --regex, --choice"),
        ({"schema": str(tmp_path / "nope.json")}, "--json-schema: cannot read"),
        ({"rf": '{"type": "yaml"}'}, "--response-format: response_format.type 'yaml'"),
        ({"choice": ("[1]",)}, "--choice: 'choice' must be a non-empty list of strings"),
        ({"ebnf": str(tmp_path)}, "--ebnf: cannot read"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):
            opts(**kwargs)


def openai_line(cid: str, url: str = "/v1/chat/completions", **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "m", **body}}


def test_openai_batch_rows(tmp_path: Path) -> None:
    lines = [
        openai_line(
            "a",
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=4,
            stop=["x", "y"],
            n=2,
            logprobs=True,
            top_logprobs=2,
            logit_bias={"1": 5},
        ),
        openai_line("b", url="/v1/completions", prompt="once", max_tokens=3, logprobs=2),
        openai_line("c", url="/v1/embeddings", input="x"),
        openai_line("d"),
        {"custom_id": "e", "url": "/v1/completions", "method": "GET", "body": {"prompt": "x"}},
        {"url": "/v1/completions", "body": {"prompt": "x"}},
    ]
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    raws = [r for b in open_dataset(path).iter_batches() for r in b]
    assert detect_openai_batch(raws[0].data) and not detect_openai_batch({"prompt": "x"})
    out = [prepare_row(r, SPEC, DEFAULTS, openai=True) for r in raws]
    a, b, c, d, e, f = out
    assert isinstance(a, PreparedRow) and a.openai and a.id == "a"
    assert a.params.max_new_tokens == 4 and a.params.stop == ("x", "y") and a.params.n == 2
    assert a.params.logprobs and a.params.top_logprobs == 2
    assert a.extra == {
        "url": "/v1/chat/completions",
        "method": "POST",
        "model": "m",
        "unsupported_fields": ["logit_bias"],
    }
    assert isinstance(b, PreparedRow) and b.prompt == "once" and b.messages is None
    assert b.params.max_new_tokens == 3 and b.params.top_logprobs == 2 and b.params.logprobs
    assert isinstance(c, RowError) and c.id == "c"
    assert "'/v1/embeddings' is not supported" in c.message
    assert isinstance(d, RowError) and "body has no 'messages'" in d.message
    assert isinstance(e, RowError) and "method 'GET'" in e.message
    assert isinstance(f, RowError) and f.id == "5"
    assert "no value in id column 'custom_id'" in f.message


def test_openai_row_messages_name_body_fields() -> None:
    def run(**body):
        return prepare_row(RawRow(0, openai_line("a", **body), None), SPEC, DEFAULTS, True)

    err = run(messages=None)
    assert isinstance(err, RowError) and "body.messages is null" in err.message, err.message
    err = run(messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    assert isinstance(err, RowError) and "'body.max_tokens' must be >= 1, got 0" in err.message
    assert "new_tokens" not in err.message


# ----------------------------------------------------------------------------- tokenize

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    text = ["system user assistant hello world how are you", "the quick brown fox says hi"]
    tok.train_from_iterator(text, trainers.WordLevelTrainer(special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="<|im_end|>"
    )
    fast.chat_template = CHATML
    return fast


def test_tokenize_prompts_and_messages(tokenizer) -> None:
    rows = [
        prep({"prompt": "hello world"}, row=0),
        prep({"messages": [{"role": "user", "content": "how are you"}]}, row=1),
    ]
    spec = RowSpec(system_prompt="the fox")
    out = tokenize_rows(tokenizer, rows, spec, context_len=64)
    assert all(isinstance(t, TokenizedRow) for t in out)
    ids = tokenizer.convert_tokens_to_ids
    start, end = ids("<|im_start|>"), ids("<|im_end|>")
    # The prompt row is wrapped in the template with the system prompt; no extra BOS.
    assert out[0].input_ids == [
        start,
        ids("system"),
        ids("the"),
        ids("fox"),
        end,
        start,
        ids("user"),
        ids("hello"),
        ids("world"),
        end,
        start,
        ids("assistant"),
    ]
    # The messages row was prepared with SPEC (no system prompt), so it has none.
    assert out[1].input_ids[:2] == [start, ids("user")] and out[1].prepared is rows[1]

    plain = tokenize_rows(tokenizer, rows[:1], RowSpec(use_chat_template=False), 64)
    assert plain[0].input_ids == [ids("<s>"), ids("hello"), ids("world")]


def test_openai_completions_rows_are_raw_text_whatever_the_template_flag(tokenizer) -> None:
    ids = tokenizer.convert_tokens_to_ids
    completion = prep(openai_line("c", url="/v1/completions", prompt="hello world"), openai=True)
    chat = prep(openai_line("m", messages=[{"role": "user", "content": "hi"}]), openai=True)
    for spec in (SPEC, RowSpec(system_prompt="the fox"), RowSpec(use_chat_template=False)):
        out = tokenize_rows(tokenizer, [completion, chat], spec, context_len=64)
        # as a server tokenizes a completions prompt: the text itself, with BOS
        assert out[0].input_ids == [ids("<s>"), ids("hello"), ids("world")]
        # a chat row keeps the template
        assert out[1].input_ids[:2] == [ids("<|im_start|>"), ids("user")]


def test_tokenize_errors(tokenizer) -> None:
    long = prep({"prompt": "hi " * 40, "max_tokens": 30}, row=0)
    ok = prep({"prompt": "hi"}, row=1)
    msgs = prep({"messages": [{"role": "user", "content": "hi"}]}, row=2)
    out = tokenize_rows(tokenizer, [long, ok, msgs], RowSpec(use_chat_template=False), 50)
    assert isinstance(out[0], RowError) and out[0].type == "context_length_exceeded"
    assert "prompt (41 tokens) + max_tokens (30) = 71" in out[0].message
    assert "context length (50:" in out[0].message and "lower max_tokens" in out[0].message
    assert isinstance(out[1], TokenizedRow) and isinstance(out[2], TokenizedRow)

    saved = tokenizer.chat_template
    tokenizer.chat_template = None
    try:
        out = tokenize_rows(tokenizer, [ok, msgs], SPEC, 50)
    finally:
        tokenizer.chat_template = saved
    assert isinstance(out[0], TokenizedRow)  # a prompt row falls back to plain tokenizing
    assert isinstance(out[1], RowError) and "no chat template" in out[1].message
    assert out[1].row == 2 and out[1].id == "2"


def test_tokenize_broken_template_and_empty(tokenizer) -> None:
    saved = tokenizer.chat_template
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    try:
        out = tokenize_rows(tokenizer, [prep({"prompt": "hi"})], SPEC, 50)
    finally:
        tokenizer.chat_template = saved
    assert isinstance(out[0], RowError) and "chat template failed" in out[0].message


class _EmptyTokenizer:
    chat_template = None

    def __call__(self, texts: list[str], **kwargs) -> dict:
        return {"input_ids": [[] for _ in texts]}


def test_tokenize_empty_result() -> None:
    out = tokenize_rows(_EmptyTokenizer(), [prep({"prompt": "   "})], SPEC, 50)
    assert isinstance(out[0], RowError) and "0 tokens" in out[0].message


# -- pre-tokenized rows -----------------------------------------------------------------------


class _NoTokenizer:
    """Fails any use: pre-tokenized rows must never reach the tokenizer."""

    chat_template = "{{ messages }}"

    def __call__(self, *args, **kwargs):
        raise AssertionError("the tokenizer ran")

    def apply_chat_template(self, *args, **kwargs):
        raise AssertionError("the chat template ran")


def test_prompt_token_ids_skip_the_tokenizer_and_the_template() -> None:
    rows = [
        prep({"prompt_token_ids": [5, 6, 7], "prompt": "the text they came from"}, row=0),
        prep({"prompt_token_ids": "[1, 2]", "max_tokens": 3}, row=1),  # Parquet / CSV text
        prep({"prompt_token_ids": [4.0, 9]}, row=2),  # pandas: ints as floats
    ]
    assert rows[0].prompt_token_ids == [5, 6, 7] and rows[0].prompt is None
    out = tokenize_rows(_NoTokenizer(), rows, SPEC, context_len=64, vocab_size=10)
    assert [t.input_ids for t in out] == [[5, 6, 7], [1, 2], [4, 9]]
    assert out[1].prepared.params.max_new_tokens == 3


def test_bad_prompt_token_ids_are_row_errors_naming_the_value() -> None:
    for value, message in [
        ([], "'prompt_token_ids' is empty"),
        ("12", "'prompt_token_ids' must be a list of token ids, got int"),
        ([1, "2"], "prompt_token_ids[1] is '2': token ids are integers >= 0"),
        ([1, -3], "prompt_token_ids[1] is -3"),
        ([True], "prompt_token_ids[0] is True"),
        ([1.5], "prompt_token_ids[0] is 1.5"),
    ]:
        err = prep({"prompt_token_ids": value})
        assert isinstance(err, RowError) and err.type == "invalid_request", value
        assert err.message.startswith("row 3: ") and message in err.message, err.message
    rows = [prep({"prompt_token_ids": [1, 2, 10, 11]}, row=4), prep({"prompt_token_ids": [3]})]
    out = tokenize_rows(_NoTokenizer(), rows, SPEC, context_len=64, vocab_size=10)
    assert isinstance(out[0], RowError) and out[0].row == 4
    assert out[0].message == (
        "row 4: prompt_token_ids[2] is 10, outside the model's vocabulary (ids 0 to 9); "
        "tokenize with this model's tokenizer"
    )
    assert isinstance(out[1], TokenizedRow)


def test_prompt_token_ids_are_checked_against_the_context_length() -> None:
    row = prep({"prompt_token_ids": list(range(40)), "max_tokens": 30})
    (out,) = tokenize_rows(_NoTokenizer(), [row], SPEC, context_len=50, vocab_size=100)
    assert isinstance(out, RowError) and out.type == "context_length_exceeded"
    assert "prompt (40 tokens) + max_tokens (30) = 70" in out.message


# -- --keep-columns ---------------------------------------------------------------------------


def test_keep_columns_ride_along_with_rows_and_errors(tokenizer) -> None:
    spec = RowSpec(keep_columns=("topic", "id", "gold"))
    ok = prep({"prompt": "hi", "id": "q1", "topic": {"a": [1]}}, spec)
    assert ok.kept == {"topic": {"a": [1]}, "id": "q1", "gold": None}
    bad = prep({"id": "q2", "topic": "x"}, spec)  # no prompt
    assert isinstance(bad, RowError) and bad.kept == {"topic": "x", "id": "q2", "gold": None}
    unparsed = prepare_row(RawRow(5, None, "line 6: invalid JSON"), spec, DEFAULTS, False)
    assert unparsed.kept == {"topic": None, "id": None, "gold": None}
    long = prep({"prompt": "hi " * 40, "gold": 1}, spec)
    (err,) = tokenize_rows(tokenizer, [long], spec, context_len=20)
    assert isinstance(err, RowError) and err.kept == {"topic": None, "id": None, "gold": 1}
    assert prep({"prompt": "hi"}).kept is None  # nothing kept: records stay as they are
