"""Where a grammar request's answer starts (engine/thinking.AnswerGate): which output tokens its
matcher accepts and which steps get a bitmask row, for the think family (a prompt that opens
the block, one that closes it, one that leaves it to the model) and harmony (the final
channel's header), with and without the thinking budget's forced tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chat_tokenizers import ids, make_tokenizer  # noqa: E402

from batchrun.chat.markers import ThinkMarkers, think_markers  # noqa: E402
from batchrun.engine.thinking import AnswerGate  # noqa: E402

START, END = 100, 101
FORCED = (10, END, 11)  # "\n", "</think>", "\n\n"
MARKERS = ThinkMarkers("think", (START,), END, FORCED, (END,))
OPEN, CLOSED, UNDECIDED = [1, START], [1, START, 5, END, 11], [1, 2]


def walk(gate: AnswerGate, output: list[int]) -> tuple[list[bool], list[bool]]:
    """(whether each token had a bitmask row, whether the matcher accepted it)."""
    rows, accepted = [], []
    for token in output:
        rows.append(gate.constrains_next)
        accepted.append(gate.fold(token))
    return rows, accepted


def test_think_open_prompt_answer_after_the_end_token():
    gate = AnswerGate.create(MARKERS, None, OPEN)
    rows, accepted = walk(gate, [20, 21, END, 30, 31])
    assert rows == [False, False, False, True, True]
    assert accepted == [False, False, False, True, True]


def test_think_budget_answer_after_the_forced_tokens():
    gate = AnswerGate.create(MARKERS, 2, OPEN)
    rows, accepted = walk(gate, [20, 21, *FORCED, 30])
    assert accepted == [False] * 5 + [True]
    assert rows == [False] * 5 + [True]
    # the model closes the block itself before the budget: the answer follows at once
    gate = AnswerGate.create(MARKERS, 2, OPEN)
    assert walk(gate, [20, END, 30])[1] == [False, False, True]


def test_think_closed_prompt_constrains_from_the_first_token():
    gate = AnswerGate.create(MARKERS, None, CLOSED)
    assert walk(gate, [30, 31]) == ([True, True], [True, True])
    assert gate.opening_token is None


def test_think_undecided_prompt_first_token_may_open_the_thinking():
    gate = AnswerGate.create(MARKERS, 2, UNDECIDED)
    assert gate.opening_token == START
    rows, accepted = walk(gate, [START, 20, 21, *FORCED, 30])
    assert rows == [True] + [False] * 5 + [True]
    assert accepted == [False] * 6 + [True]
    # the first token is the answer's: no thinking after it
    gate = AnswerGate.create(MARKERS, 2, UNDECIDED)
    assert walk(gate, [30, START, 31]) == ([True] * 3, [True] * 3)
    assert gate.opening_token is None


@pytest.fixture(scope="module")
def harmony():
    tok = make_tokenizer("gpt_oss")
    return tok, think_markers(tok)


@pytest.mark.parametrize("limit", [None, 50])
def test_harmony_answer_after_the_final_header(harmony, limit):
    tok, markers = harmony
    assert markers.family == "harmony"
    head = ids(tok, "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant"
                    "<|channel|>final<|message|>")  # fmt: skip
    answer = ids(tok, '{"ok": true}')
    gate = AnswerGate.create(markers, limit, ids(tok, "<|start|>assistant"))
    rows, accepted = walk(gate, head + answer)
    assert rows == [False] * len(head) + [True] * len(answer)
    assert accepted == rows


def test_harmony_budget_forced_header(harmony):
    tok, markers = harmony
    start = ids(tok, "<|channel|>analysis<|message|>")
    gate = AnswerGate.create(markers, 3, ids(tok, "<|start|>assistant"))
    head = [*start, 40, 41, 42, *markers.forced_ids]
    rows, accepted = walk(gate, [*head, 50])
    assert accepted == [False] * len(head) + [True]
    assert rows == accepted


def test_harmony_text_completion_constrains_from_the_first_token(harmony):
    # no template wrote an assistant message: the model need not write channels
    tok, markers = harmony
    for prompt in ("Say yes:", "<|start|>user<|message|>Hi<|end|>"):
        gate = AnswerGate.create(markers, None, ids(tok, prompt))
        assert walk(gate, ids(tok, '{"ok": 1}'))[1] == [True] * len(ids(tok, '{"ok": 1}'))
