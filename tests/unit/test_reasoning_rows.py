"""Rows of thinking and tool-calling models: per-row chat-template options (chat_template_kwargs
over --chat-template-kwargs, tools, tool_choice, reasoning_effort), multi-turn messages with tool
calls, tool results and past reasoning rendered as the templates expect, the records and OpenAI
Batch output lines (validated with the `openai` package's types), and the fingerprint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chat_tokenizers import ids, make_tokenizer  # noqa: E402

from batchrun.chat.parsers import OutputParser, resolve_parsers  # noqa: E402
from batchrun.io.readers import RawRow  # noqa: E402
from batchrun.io.records import (  # noqa: E402
    Completion,
    encode_line,
    openai_result_record,
    result_records,
)
from batchrun.io.rows import PreparedRow, RowError, RowSpec, prepare_row  # noqa: E402
from batchrun.job.config import RunConfig  # noqa: E402
from batchrun.job.resume import fingerprint_diff, make_fingerprint  # noqa: E402
from batchrun.job.tokenize import TokenizedRow, tokenize_rows  # noqa: E402
from batchrun.params import SamplingParams  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
]
DEFAULTS = SamplingParams(max_new_tokens=8)
SPEC = RowSpec()


@pytest.fixture(scope="module")
def toks():
    return {f: make_tokenizer(f) for f in ("qwen3", "deepseek_r1", "gpt_oss", "llama3")}


def row(data: dict, spec: RowSpec = SPEC, openai: bool = False):
    return prepare_row(RawRow(0, data, None), spec, DEFAULTS, openai)


def render(tok, data: dict, spec: RowSpec = SPEC) -> tuple[str, PreparedRow]:
    prepared = row(data, spec)
    assert isinstance(prepared, PreparedRow), prepared
    (out,) = tokenize_rows(tok, [prepared], spec, context_len=4096)
    assert isinstance(out, TokenizedRow), out
    return tok.decode(out.input_ids), out.prepared


USER = [{"role": "user", "content": "hi"}]


def test_enable_thinking_false_changes_the_prompt_as_the_template_says(toks):
    tok = toks["qwen3"]
    on, prepared_on = render(tok, {"messages": USER})
    assert on.endswith("<|im_start|>assistant\n") and not prepared_on.thinking_open
    off_kwargs = {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}
    off, _ = render(tok, off_kwargs)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # --chat-template-kwargs for every row; a row's own win
    spec = RowSpec(chat_template_kwargs={"enable_thinking": False})
    assert render(tok, {"messages": USER}, spec)[0] == off
    row_on = {"messages": USER, "chat_template_kwargs": '{"enable_thinking": true}'}
    assert render(tok, row_on, spec)[0] == on


def test_a_template_that_opens_thinking_marks_the_row(toks):
    _, prepared = render(toks["deepseek_r1"], {"messages": USER})
    assert prepared.thinking_open
    # with a response format too: its grammar applies to the answer (engine/thinking.py)
    constrained = row({"messages": USER, "response_format": {"type": "json_object"}})
    (out,) = tokenize_rows(toks["deepseek_r1"], [constrained], SPEC, context_len=4096)
    assert out.prepared.thinking_open and out.prepared.params.grammar is not None


def test_tools_tool_choice_and_reasoning_effort_reach_the_template(toks):
    text, _ = render(toks["qwen3"], {"messages": USER, "tools": TOOLS})
    assert '"name": "get_weather"' in text and "<tools>" in text
    none, _ = render(toks["qwen3"], {"messages": USER, "tools": TOOLS, "tool_choice": "none"})
    assert "<tools>" not in none
    high, _ = render(toks["gpt_oss"], {"messages": USER, "reasoning_effort": "high"})
    assert "Reasoning: high" in high
    bad = row({"messages": USER, "tools": TOOLS, "tool_choice": "required"})
    assert isinstance(bad, RowError) and "'tool_choice' 'required' is not supported" in bad.message
    bad = row({"messages": USER, "reasoning_effort": "max"})
    assert isinstance(bad, RowError) and "one of low, medium, high" in bad.message
    bad = row({"messages": USER, "tools": [{"name": "x"}]})
    assert isinstance(bad, RowError) and "'tools' must be a list of tools" in bad.message


def test_openai_body_fields(toks):
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": USER, "tools": TOOLS, "reasoning_effort": "low"},
    }
    prepared = row(line, openai=True)
    assert prepared.template_kwargs == {"reasoning_effort": "low", "tools": TOOLS}
    assert "unsupported_fields" not in prepared.extra


CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Use the tool.",
        "tool_calls": [CALL],
    },  # fmt: skip
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
]


def test_multi_turn_tool_calls_results_and_reasoning(toks):
    qwen, _ = render(toks["qwen3"], {"messages": TURNS, "tools": TOOLS})
    assert "<think>\nUse the tool.\n</think>" in qwen
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in qwen
    )
    assert "<tool_response>\nsunny\n</tool_response>" in qwen
    # arguments sent as text reach a `tojson` template as an object, not as a quoted string
    llama, _ = render(toks["llama3"], {"messages": TURNS, "tools": TOOLS})
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in llama
    # gpt-oss's template reads the reasoning as `thinking`
    oss, _ = render(toks["gpt_oss"], {"messages": TURNS, "tools": TOOLS})
    assert "<|channel|>analysis<|message|>Use the tool.<|end|>" in oss
    assert "commentary to=functions.get_weather" in oss and "sunny" in oss


def test_max_thinking_tokens_per_row_and_refused_without_thinking_tokens(toks):
    prepared = row({"prompt": "hi", "max_thinking_tokens": 5})
    assert prepared.params.max_thinking_tokens == 5
    bad = row({"prompt": "hi", "max_thinking_tokens": 0})
    assert isinstance(bad, RowError) and "'max_thinking_tokens' must be >= 1" in bad.message
    (out,) = tokenize_rows(toks["llama3"], [prepared], RowSpec(), context_len=4096)
    assert isinstance(out, RowError) and "needs a thinking model" in out.message


def completion(tok, text: str, finish: str = "stop", **kw) -> Completion:
    out = ids(tok, text)
    p = OutputParser(tok, resolve_parsers(tok)).parse(out, call_seed="a\0" + "0", **kw)
    if p.tool_calls and finish == "stop":
        finish = "tool_calls"
    return Completion(0, p.text, out, finish, 10, len(out), 0, reasoning=p.reasoning,
                      tool_calls=p.tool_calls, warning=p.warning)  # fmt: skip


def openai_line(prepared, completions) -> dict:
    record = openai_result_record(prepared, completions, model="m", created=1)
    return msgspec.json.decode(encode_line(record))


def test_openai_output_validates_against_the_openai_types(toks):
    from openai.types.chat import ChatCompletion

    tok = toks["qwen3"]
    prepared = row({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": USER}}, openai=True)  # fmt: skip
    calls = completion(
        tok,
        "<think>\nNeed weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": {"name": "Paris"}}}\n'
        "</tool_call><|im_end|>",
    )
    line = openai_line(prepared, [calls])
    body = ChatCompletion.model_validate(line["response"]["body"])
    choice = body.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.reasoning_content == "Need weather."  # an extra field, as servers send
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": {"name": "Paris"}}

    answer = completion(tok, "<think>\nEasy.\n</think>\n\nHello!<|im_end|>")
    msg = ChatCompletion.model_validate(openai_line(prepared, [answer])["response"]["body"])
    m = msg.choices[0].message
    assert (m.content, m.reasoning_content, m.tool_calls) == ("Hello!", "Easy.", None)

    cut = completion(tok, "<think>\nStill going", finish="length")
    body = ChatCompletion.model_validate(openai_line(prepared, [cut])["response"]["body"])
    assert body.choices[0].finish_reason == "length"
    assert (body.choices[0].message.content, body.choices[0].message.reasoning_content) == (
        "",
        "Still going",
    )


def test_plain_records_carry_reasoning_tool_calls_and_warning(toks):
    tok = toks["qwen3"]
    prepared = row({"prompt": "hi"})
    bad = completion(tok, '<think>\nhm\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {,}}'
                          "\n</tool_call><|im_end|>")  # fmt: skip
    (rec,) = result_records(prepared, [bad])
    line = msgspec.json.decode(encode_line(rec))
    assert list(line)[:5] == ["id", "text", "reasoning", "warning", "finish_reason"]
    assert line["reasoning"] == "hm" and '"name": "f"' in line["text"] and line["warning"]
    good = completion(tok, '<tool_call>\n{"name": "f", "arguments": {"a": [1]}}\n</tool_call>')
    line = msgspec.json.decode(encode_line(result_records(prepared, [good])[0]))
    assert line["finish_reason"] == "tool_calls" and "reasoning" not in line
    (call,) = line["tool_calls"]
    assert call["type"] == "function" and call["function"] == {
        "name": "f",
        "arguments": '{"a": [1]}',
    }


def test_budget_and_parsers_are_in_the_fingerprint(tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    base = RunConfig(str(data), str(tmp_path / "out"))
    fp = make_fingerprint(base, "jsonl")
    assert "reasoning_parser" not in fp["output"] and "chat_template_kwargs" not in fp["rows"]
    budget = RunConfig(
        str(data), str(tmp_path / "out"), defaults=SamplingParams(max_thinking_tokens=64)
    )
    diff = fingerprint_diff(fp, make_fingerprint(budget, "jsonl"))
    assert diff == ["sampling defaults: --max-thinking-tokens None -> 64"]
    parser = RunConfig(str(data), str(tmp_path / "out"), reasoning_parser="none")
    assert fingerprint_diff(fp, make_fingerprint(parser, "jsonl"))[0].startswith("output options")
    kwargs = RunConfig(str(data), str(tmp_path / "out"),
                       spec=RowSpec(chat_template_kwargs={"enable_thinking": False}))  # fmt: skip
    assert fingerprint_diff(fp, make_fingerprint(kwargs, "jsonl"))[0].startswith("row options")
