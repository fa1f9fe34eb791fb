"""Tool calls parsed per format on model outputs given as token ids: Qwen / Hermes <tool_call>
JSON, gpt-oss harmony commentary calls, Llama 3.x JSON calls, Mistral [TOOL_CALLS] (both
tokenizer versions), Gemma 4's <|tool_call>call:NAME{...}<tool_call|>; nested arguments, two
calls in one answer, a malformed call kept as text with a warning."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chat_tokenizers import ids, make_tokenizer  # noqa: E402

from batchrun.chat.parsers import OutputParser, resolve_parsers  # noqa: E402

NESTED = {"location": {"city": "Paris", "country": "FR"}, "days": [1, 2], "units": "metric"}


@pytest.fixture(scope="module")
def toks():
    return {f: make_tokenizer(f) for f in ("qwen3", "gpt_oss", "llama3", "mistral")}


def parse(tok, text: str, **kw):
    return OutputParser(tok, resolve_parsers(tok)).parse(ids(tok, text), call_seed="r1", **kw)


def calls(p) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in p.tool_calls or ()]


def test_hermes_two_calls_with_nested_arguments_after_thinking(toks):
    out = (
        "<think>\nI need the weather and the time.\n</think>\n\nLet me check.\n"
        f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(NESTED)}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
        "<|im_end|>"
    )
    p = parse(toks["qwen3"], out)
    assert p.reasoning == "I need the weather and the time."
    assert p.text == "Let me check."
    assert calls(p) == [("get_weather", NESTED), ("get_time", {"tz": "Europe/Paris"})]
    ids_ = [c.id for c in p.tool_calls]
    assert len(set(ids_)) == 2 and all(i.startswith("call_") and len(i) == 29 for i in ids_)
    assert p.warning is None
    # the same completion gets the same ids on every run (a resumed run writes the same)
    assert [c.id for c in parse(toks["qwen3"], out).tool_calls] == ids_


def test_hermes_malformed_call_is_kept_as_text_with_a_warning(toks):
    out = (
        '<tool_call>\n{"name": "ok", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "broken", "arguments": {"a": 1,}\n</tool_call><|im_end|>'
    )
    p = parse(toks["qwen3"], out)
    assert calls(p) == [("ok", {})]
    assert '{"name": "broken", "arguments": {"a": 1,}' in p.text
    assert "1 tool call(s) did not parse" in p.warning


def test_plain_answer_has_no_calls(toks):
    p = parse(toks["qwen3"], "Just text.<|im_end|>")
    assert (p.text, p.tool_calls, p.warning) == ("Just text.", None, None)


def test_a_row_without_tools_gets_no_calls_parsed(toks):
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    p = parse(toks["qwen3"], call + "<|im_end|>", with_tools=False)
    assert (p.text, p.tool_calls, p.warning) == (call, None, None)


def test_harmony_commentary_calls(toks):
    out = (
        "<|channel|>analysis<|message|>Need weather and time.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        f"<|message|>{json.dumps(NESTED)}<|call|>"
        "<|start|>assistant to=functions.get_time<|channel|>commentary json"
        '<|message|>{"tz": "UTC"}<|call|>'
    )
    p = parse(toks["gpt_oss"], out)
    assert p.reasoning == "Need weather and time."
    assert calls(p) == [("get_weather", NESTED), ("get_time", {"tz": "UTC"})]
    assert p.text == ""


def test_harmony_malformed_call(toks):
    out = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{not json<|call|>"
    p = parse(toks["gpt_oss"], out)
    assert p.tool_calls is None and "{not json" in p.text and p.warning


def test_llama3_json_calls(toks):
    tok = toks["llama3"]
    one = parse(tok, f'<|python_tag|>{{"name": "get_weather", "parameters": {json.dumps(NESTED)}}}'
                     "<|eom_id|>")  # fmt: skip
    assert calls(one) == [("get_weather", NESTED)] and one.text == ""
    two = parse(tok, '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert calls(two) == [("a", {"x": 1}), ("b", {})]
    answer = parse(tok, '{"name": "Bob", "age": 3}<|eot_id|>')  # JSON, but no call
    assert (answer.text, answer.tool_calls) == ('{"name": "Bob", "age": 3}', None)
    plain = parse(tok, "The weather is fine.<|eot_id|>")
    assert (plain.text, plain.tool_calls) == ("The weather is fine.", None)
    bad = parse(tok, '<|python_tag|>{"name": "a", "parameters": {"x": }<|eom_id|>')
    assert bad.tool_calls is None and '"parameters": {"x": }' in bad.text and bad.warning


def test_mistral_v3_list_and_v11_named_calls(toks):
    tok = toks["mistral"]
    v3 = parse(tok, f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {json.dumps(NESTED)}}}, '
                    '{"name": "get_time", "arguments": {"tz": "UTC"}}]</s>')  # fmt: skip
    assert calls(v3) == [("get_weather", NESTED), ("get_time", {"tz": "UTC"})]
    v11 = parse(tok, 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
                     '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}</s>')  # fmt: skip
    assert calls(v11) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]
    assert v11.text == "Sure."
    bad = parse(tok, '[TOOL_CALLS][{"name": "f", "arguments": </s>')
    assert bad.tool_calls is None and "[TOOL_CALLS]" in bad.text and bad.warning


def q(text: str) -> str:
    """A Gemma 4 string value: delimited by the <|"|> token."""
    return f'<|"|>{text}<|"|>'


def test_gemma4_two_calls_with_nested_arguments_after_thinking():
    tok = make_tokenizer("gemma4")
    out = (
        "<|channel>thought\nI need the weather and the time.\n<channel|>"
        f"<|tool_call>call:get_weather{{location:{{city:{q('Paris')},country:{q('FR')}}},"
        f"days:[1,2],units:{q('metric')}}}<tool_call|>"
        f"<|tool_call>call:get_time{{tz:{q('Europe/Paris, {CET}')},dst:true}}<tool_call|><turn|>"
    )
    p = parse(tok, out)
    assert p.reasoning == "I need the weather and the time."
    assert calls(p) == [
        ("get_weather", NESTED),
        ("get_time", {"tz": "Europe/Paris, {CET}", "dst": True}),
    ]
    assert (p.text, p.warning) == ("", None)
    assert len({c.id for c in p.tool_calls}) == 2


def test_gemma4_malformed_call_is_kept_as_text_with_a_warning():
    tok = make_tokenizer("gemma4")
    bad = f"<|tool_call>call:get_weather{{city:{q('Paris')},<tool_call|>"
    p = parse(tok, f"Checking.{bad}<turn|>")
    assert p.tool_calls is None and p.warning is not None and "gemma4" in p.warning
    assert p.text == f"Checking.\n{bad}"
    plain = parse(tok, "The weather is fine.<turn|>")
    assert (plain.text, plain.tool_calls) == ("The weather is fine.", None)
