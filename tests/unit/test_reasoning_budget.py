"""The thinking budget's host-side plan (engine/thinking.py): which output token is forced, with
and without the one-step lag of overlap scheduling, and the device-side override with its
condition on the token before."""

from __future__ import annotations

import torch

from batchrun.chat.markers import ThinkMarkers
from batchrun.engine.thinking import (
    NO_CONDITION,
    ThinkingBudget,
    apply_forced,
    forced_logprobs,
)

START, END = 100, 101
FORCED = (10, END, 11)  # "\n", "</think>", "\n\n"
MARKERS = ThinkMarkers("think", (START,), END, FORCED, (END,))


def drive(model: list[int], limit: int, lag: int, prompt_open: bool = True) -> list[int]:
    """The output of a "model" that writes `model` token by token, with the budget's overrides
    applied as the engine does: the host knows all but the last `lag` tokens at each launch,
    and a conditional override is cancelled when the token before is the end token."""
    budget = ThinkingBudget.create(MARKERS, limit, [1, 2, START] if prompt_open else [1, 2])
    out: list[int] = []
    written = iter(model)
    while len(out) < 12:
        j = len(out)
        o = budget.override(j, out, max(0, j - lag))
        token = next(written)
        if o is not None and not (o[1] != NO_CONDITION and out and out[-1] == o[1]):
            token = o[0]
        out.append(token)
    return out


def test_budget_forces_the_end_after_exactly_n_reasoning_tokens():
    model = list(range(20, 40))
    for lag in (0, 1):
        out = drive(model, limit=4, lag=lag)
        assert out[:4] == model[:4] and out[4:7] == list(FORCED) and out[7:] == model[7:12]


def test_a_model_that_ends_thinking_itself_is_not_forced():
    model = [20, 21, END, 30, 31, 32, 33, 34, 35, 36, 37, 38]
    for lag in (0, 1):
        assert drive(model, limit=5, lag=lag) == model


def test_ending_on_the_last_budget_token_cancels_the_conditional_override():
    # the budget's last token (index 3) is the end token: under overlap the host launches
    # token 4 before it sees token 3, with an override the device cancels
    model = [20, 21, 22, END, 30, 31, 32, 33, 34, 35, 36, 37]
    for lag in (0, 1):
        assert drive(model, limit=4, lag=lag) == model


def test_thinking_opened_by_the_model():
    model = [7, START, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    for lag in (0, 1):
        out = drive(model, limit=3, lag=lag, prompt_open=False)
        assert out[:5] == model[:5] and out[5:8] == list(FORCED) and out[8:] == model[8:12]


def test_apply_forced_on_the_device_tensors():
    next_ids = torch.tensor([5, 6, 7, 8])
    prev = torch.tensor([1, END, 3, 4])
    forced = torch.tensor([[0, 1, 3], [10, 10, 11], [END, END, NO_CONDITION]])
    assert apply_forced(next_ids, forced, prev).tolist() == [10, 6, 7, 11]


def test_forced_rows_get_the_logprob_of_the_forced_token():
    logits = torch.randn(3, 16)
    next_ids = torch.tensor([4, 10, 6])  # row 1 forced to 10
    forced = torch.tensor([[1], [10], [NO_CONDITION]])
    sampled = torch.tensor([-1.0, -2.0, -3.0])
    lp = forced_logprobs(logits, forced, next_ids, sampled)
    assert lp[0] == -1.0 and lp[2] == -3.0
    assert torch.allclose(lp[1], torch.log_softmax(logits[1], -1)[10])
