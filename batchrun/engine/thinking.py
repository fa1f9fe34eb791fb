"""The thinking budget: a request's reasoning ends after ``max_thinking_tokens`` tokens, the
model's own way (ThinkMarkers.forced_ids: ``\\n</think>\\n\\n``, or harmony's ``<|end|>`` and the
final channel's header), and the answer follows.

The forced tokens are a per-request override of the sampled id, applied on the device where the
sampler's output is taken (ModelRunner._sample), like the stop tokens and min_new_tokens: decided
on the host from the tokens it has seen, with no host sync added. With overlap the host sees
output token j-1 only after it launches the step that samples token j; when the budget's last
token is j-1, whether j is forced depends on it (it may close the block itself), so that one
override carries a condition the device checks against the token it sampled for j-1:

    known tokens [:k]  -> phase, reasoning count   (fold)
    j = k (no overlap) or k + 1 (overlap: j-1 on the device only)
    FORCING: force forced_ids[j - forced_from]
    OPEN, count == limit, j = k:           force forced_ids[0]
    OPEN, count == limit - 1, j = k + 1:   force forced_ids[0] unless token j-1 is the end token

Both give the same tokens; the forced tokens are not reasoning (the parsers cut at the end
token), so the reasoning holds at most `limit` tokens the model wrote.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from batchrun.chat.markers import HARMONY, ThinkMarkers

BEFORE, OPEN, FORCING, DONE = range(4)
NO_CONDITION = -1  # never a token id


@dataclass(eq=False, slots=True)
class ThinkingBudget:
    """One request's budget state, folded from its output tokens as the host sees them."""

    markers: ThinkMarkers
    limit: int
    phase: int
    count: int = 0  # reasoning tokens folded
    seen: int = 0  # output tokens folded
    matched: int = 0  # start tokens matched so far (BEFORE)
    forced_from: int = -1  # output index of the first forced token (FORCING)

    @classmethod
    def create(cls, markers: ThinkMarkers, limit: int, prompt_ids: list[int]) -> ThinkingBudget:
        return cls(markers, limit, OPEN if markers.opens_in(prompt_ids) else BEFORE)

    def fold(self, output_ids: list[int], upto: int) -> None:
        start, end_id = self.markers.start_ids, self.markers.end_id
        for idx in range(self.seen, upto):
            token = output_ids[idx]
            if self.phase == BEFORE:
                if token == start[self.matched]:
                    self.matched += 1
                    if self.matched == len(start):
                        self.phase = OPEN
                else:
                    self.matched = 1 if token == start[0] else 0
            elif self.phase == OPEN:
                if token == end_id:
                    self.phase = DONE
                else:
                    self.count += 1
                    if self.count >= self.limit:
                        self.phase, self.forced_from = FORCING, idx + 1
        self.seen = max(self.seen, upto)

    def override(self, j: int, output_ids: list[int], num_known: int) -> tuple[int, int] | None:
        """(token, condition) to force as output token j, or None; condition: the token j-1
        that cancels it (NO_CONDITION: none). `num_known`: output tokens the host has seen."""
        self.fold(output_ids, num_known)
        forced = self.markers.forced_ids
        if self.phase == FORCING:
            k = j - self.forced_from
            if k < len(forced):
                return forced[k], NO_CONDITION
            self.phase = DONE
            return None
        if self.phase == OPEN and num_known == j - 1 and self.count == self.limit - 1:
            return forced[0], self.markers.end_id
        return None


WAIT, FIRST, ANSWER = range(3)  # AnswerGate phases


@dataclass(eq=False, slots=True)
class AnswerGate:
    """Where a grammar request's answer starts: its grammar applies to the answer, not to the
    thinking. Folded by the fill jobs (engine/structured.py) from the output tokens in order;
    each fill knows every token before the one it masks, so no lag applies here.

        WAIT   thinking, or before harmony's final header (in an assistant message the prompt
               opens): no bitmask row, the matcher idle;
               the answer starts after `answer_ids` (</think>; <|channel|>final<|message|>),
               or after the budget's forced tokens (their own fold, as ThinkingBudget's)
        FIRST  a think-family prompt that neither opens nor closes the block, first token:
               the grammar's row, plus the start token (the model may open its thinking)
        ANSWER the grammar constrains every token (from the first: markers.answers_first)
    """

    markers: ThinkMarkers
    budget: ThinkingBudget  # a fold of its own, to tell the forced tokens
    phase: int
    tokens: list[int] = field(default_factory=list)  # output tokens folded
    matched: int = 0  # answer_ids matched so far (WAIT)

    @classmethod
    def create(cls, markers: ThinkMarkers, limit: int | None, prompt_ids: list[int]) -> AnswerGate:
        budget = ThinkingBudget.create(markers, limit or sys.maxsize, prompt_ids)
        if markers.answers_first(prompt_ids):
            phase = ANSWER
        elif markers.family == HARMONY or markers.opens_in(prompt_ids):
            phase = WAIT
        else:
            phase = FIRST
        return cls(markers, budget, phase)

    @property
    def constrains_next(self) -> bool:
        """Whether the next token gets a bitmask row."""
        return self.phase != WAIT

    @property
    def opening_token(self) -> int | None:
        """A token the next row allows beside the grammar's (FIRST: the start token)."""
        return self.markers.start_ids[0] if self.phase == FIRST else None

    def fold(self, token: int) -> bool:
        """The next output token; True when it is the answer's (the matcher accepts it)."""
        if self.phase == ANSWER:
            return True
        idx = len(self.tokens)
        self.tokens.append(token)
        budget = self.budget
        budget.fold(self.tokens, idx + 1)
        if self.phase == FIRST:
            self.phase = WAIT if token == self.markers.start_ids[0] else ANSWER
            return self.phase == ANSWER
        if budget.phase == FORCING and idx >= budget.forced_from:
            # a forced token; the answer starts after the last one
            if idx + 1 == budget.forced_from + len(self.markers.forced_ids):
                self.phase = ANSWER
            return False
        header = self.markers.answer_ids
        if token == header[self.matched]:
            self.matched += 1
            if self.matched == len(header):
                self.phase = ANSWER
        else:
            self.matched = 1 if token == header[0] else 0
        return False


def apply_forced(
    next_ids: torch.Tensor, forced: torch.Tensor, prev_ids: torch.Tensor
) -> torch.Tensor:
    """next_ids [S] with the forced overrides: forced [3, F] int64 (batch index, token,
    condition); prev_ids [S]: each row's token of the step before (the token pool's)."""
    index, tokens, condition = forced
    keep = prev_ids[index] == condition
    chosen = torch.where(keep, next_ids[index], tokens.to(next_ids.dtype))
    return next_ids.index_copy(0, index, chosen)


def forced_logprobs(
    logits: torch.Tensor, forced: torch.Tensor, next_ids: torch.Tensor, logprobs: torch.Tensor
) -> torch.Tensor:
    """logprobs [S] with the forced rows' entries for the token they ended with (the sampler
    gave the one it drew): the raw log_softmax of logits [S, V] there, as for any token."""
    index = forced[0]
    rows = torch.log_softmax(logits[index].float(), dim=-1)  # [F, V]
    chosen = rows.gather(1, next_ids[index][:, None]).squeeze(1)
    return logprobs.index_copy(0, index, chosen.to(logprobs.dtype))
