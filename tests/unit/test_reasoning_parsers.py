"""Reasoning kept apart from the answer, per family, on model outputs given as token ids: the
<think> family (a block the model opens, one the template opened in the prompt, thinking cut by
max_tokens, thinking turned off), gpt-oss's harmony channels and Gemma 4's thought channel;
`auto` from the tokenizer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chat_tokenizers import ids, make_tokenizer  # noqa: E402

from batchrun.chat.markers import GEMMA4, HARMONY, THINK, think_markers  # noqa: E402
from batchrun.chat.parsers import OutputParser, ParserChoice, resolve_parsers  # noqa: E402
from batchrun.engine.thinking import AnswerGate, ThinkingBudget  # noqa: E402


@pytest.fixture(scope="module")
def toks():
    return {f: make_tokenizer(f) for f in ("qwen3", "deepseek_r1", "gpt_oss", "llama3", "mistral")}


def parser(tok, reasoning="auto", tools="auto") -> OutputParser:
    return OutputParser(tok, resolve_parsers(tok, reasoning, tools))


def test_auto_picks_the_family_from_the_tokenizer(toks):
    assert resolve_parsers(toks["qwen3"]) == ParserChoice(THINK, "hermes")
    assert resolve_parsers(toks["deepseek_r1"]) == ParserChoice(THINK, None)
    assert resolve_parsers(toks["gpt_oss"]) == ParserChoice(HARMONY, HARMONY)
    assert resolve_parsers(toks["llama3"]) == ParserChoice(None, "llama3_json")
    assert resolve_parsers(toks["mistral"]) == ParserChoice(None, "mistral")
    assert resolve_parsers(toks["qwen3"], "none", "none") == ParserChoice(None, None)


def test_a_parser_the_tokenizer_cannot_serve_is_refused(toks):
    with pytest.raises(ValueError, match="no <think> / </think>"):
        resolve_parsers(toks["llama3"], "qwen3")
    with pytest.raises(ValueError, match="not supported; use one of auto, none"):
        resolve_parsers(toks["llama3"], "granite")
    with pytest.raises(ValueError, match="--reasoning-parser harmony"):
        resolve_parsers(toks["gpt_oss"], "none", "harmony")


def test_qwen3_thinking_then_answer(toks):
    tok = toks["qwen3"]
    out = ids(tok, "<think>\nThe user adds 2 and 2.\n</think>\n\nIt is 4.<|im_end|>")
    p = parser(tok).parse(out)
    assert (p.reasoning, p.text) == ("The user adds 2 and 2.", "It is 4.")
    assert not p.thinking_unfinished


def test_qwen3_thinking_cut_by_max_tokens_has_no_answer(toks):
    tok = toks["qwen3"]
    p = parser(tok).parse(ids(tok, "<think>\nFirst, the user wants"))
    assert (p.reasoning, p.text, p.thinking_unfinished) == ("First, the user wants", "", True)


def test_thinking_off_in_the_template_gives_plain_text(toks):
    tok = toks["qwen3"]
    p = parser(tok).parse(ids(tok, "Hello there.<|im_end|>"), prompt_open=False)
    assert (p.reasoning, p.text) == (None, "Hello there.")


def test_a_block_opened_in_the_prompt_is_closed_by_the_output(toks):
    tok = toks["deepseek_r1"]
    messages = [{"role": "user", "content": "2+2?"}]
    prompt = ids(tok, tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    markers = think_markers(tok)
    assert markers.opens_in(prompt)
    out = ids(tok, "Two and two.\n</think>\n\n4<｜end▁of▁sentence｜>")
    p = parser(tok).parse(out, prompt_open=True)
    assert (p.reasoning, p.text) == ("Two and two.", "4")
    cut = parser(tok).parse(ids(tok, "Two and"), prompt_open=True)
    assert (cut.reasoning, cut.text, cut.thinking_unfinished) == ("Two and", "", True)


def test_reasoning_parser_none_keeps_everything_in_text(toks):
    tok = toks["qwen3"]
    p = parser(tok, "none", "none").parse(ids(tok, "<think>\nx\n</think>\n\ny"))
    assert (p.reasoning, p.text) == (None, "<think>\nx\n</think>\n\ny")


HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>User asks 2+2. Simple.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
)


def test_harmony_analysis_is_reasoning_and_final_is_text(toks):
    tok = toks["gpt_oss"]
    p = parser(tok).parse(ids(tok, HARMONY_ANSWER))
    assert (p.reasoning, p.text, p.tool_calls) == ("User asks 2+2. Simple.", "2 + 2 = 4.", None)


def test_harmony_analysis_cut_by_max_tokens(toks):
    tok = toks["gpt_oss"]
    p = parser(tok).parse(ids(tok, "<|channel|>analysis<|message|>We need to"))
    assert (p.reasoning, p.text, p.thinking_unfinished) == ("We need to", "", True)


def test_harmony_opened_in_prompt_markers(toks):
    tok = toks["gpt_oss"]
    markers = think_markers(tok)
    assert markers.family == HARMONY and markers.end_id == tok.convert_tokens_to_ids("<|end|>")
    prompt = ids(tok, "<|start|>user<|message|>hi<|end|><|start|>assistant")
    assert not markers.opens_in(prompt)
    assert markers.opens_in(prompt + ids(tok, "<|channel|>analysis<|message|>"))
    assert tok.decode(list(markers.forced_ids), skip_special_tokens=False) == (
        "<|end|><|start|>assistant<|channel|>final<|message|>"
    )


# Gemma 4, as Google's prompt-formatting page shows it: thinking on by <|think|> in the system
# turn, the model's turn starting with <|channel>thought\n ... <channel|> and then the answer
GEMMA4_ANSWER = (
    "<|channel>thought\nThe user asks for the water formula.\n<channel|>"
    "The most common water formula is H2O.<turn|>"
)


@pytest.fixture(scope="module")
def gemma4():
    return make_tokenizer("gemma4")


def test_gemma4_auto_detected_and_thinking_turned_on_in_the_system_turn(gemma4, toks):
    tok = gemma4
    assert resolve_parsers(tok) == ParserChoice(GEMMA4, GEMMA4)
    assert resolve_parsers(tok, "gemma4", "none") == ParserChoice(GEMMA4, None)
    with pytest.raises(ValueError, match=r"no Gemma 4 \(<\|channel> / <channel\|> / <\|turn>\)"):
        resolve_parsers(toks["qwen3"], "gemma4")
    messages = [{"role": "user", "content": "What is the water formula?"}]
    on = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                 enable_thinking=True)  # fmt: skip
    off = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert on == (
        "<bos><|turn>system\n<|think|><turn|>\n"
        "<|turn>user\nWhat is the water formula?<turn|>\n<|turn>model\n"
    )
    assert off == "<bos><|turn>user\nWhat is the water formula?<turn|>\n<|turn>model\n"
    markers = think_markers(tok)
    assert not markers.opens_in(ids(tok, on)) and not markers.answers_first(ids(tok, on))


def test_gemma4_thought_channel_is_reasoning_and_the_rest_is_text(gemma4):
    p = parser(gemma4).parse(ids(gemma4, GEMMA4_ANSWER))
    assert (p.reasoning, p.text, p.tool_calls, p.thinking_unfinished) == (
        "The user asks for the water formula.",
        "The most common water formula is H2O.",
        None,
        False,
    )


def test_gemma4_thinking_cut_by_max_tokens_has_no_answer(gemma4):
    p = parser(gemma4).parse(ids(gemma4, "<|channel>thought\nFirst, the user"))
    assert (p.reasoning, p.text, p.thinking_unfinished) == ("First, the user", "", True)


def test_gemma4_without_thinking_is_all_text(gemma4):
    p = parser(gemma4).parse(ids(gemma4, "H2O.<turn|>"))
    assert (p.reasoning, p.text, p.thinking_unfinished) == (None, "H2O.", False)
    # an empty thought channel: no reasoning to speak of, the answer after it
    p = parser(gemma4).parse(ids(gemma4, "<|channel>thought\n<channel|>H2O.<turn|>"))
    assert (p.reasoning, p.text) == ("", "H2O.")


def test_gemma4_budget_ends_thinking_with_the_channel_close(gemma4):
    tok = gemma4
    markers = think_markers(tok)
    assert tok.decode(list(markers.forced_ids), skip_special_tokens=False) == "<channel|>"
    assert markers.answer_ids == (tok.convert_tokens_to_ids("<channel|>"),)
    prompt = ids(tok, "<|turn>system\n<|think|><turn|>\n<|turn>user\nhi<turn|>\n<|turn>model\n")
    start = list(markers.start_ids)
    body = ids(tok, "abcdef")
    budget = ThinkingBudget.create(markers, 3, prompt)
    out: list[int] = []
    for token in [*start, *body]:
        o = budget.override(len(out), out, len(out))
        out.append(o[0] if o is not None else token)
    assert out == [*start, *body[:3], *markers.forced_ids, *body[4:]]
    # the grammar's answer starts after <channel|>; the first row may open the thinking
    gate = AnswerGate.create(markers, 3, prompt)
    assert gate.opening_token == tok.convert_tokens_to_ids("<|channel>")
    accepted = [gate.fold(t) for t in out]
    assert accepted == [False] * (len(start) + 4) + [True] * 2
