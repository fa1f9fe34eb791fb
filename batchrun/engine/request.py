"""The one mutable per-request object the scheduler moves around.

Token positions of a request, and what its counters mean:

    fill_ids = input_ids + output_ids
    [0 ............ prefix_len ............ kv_len ............ alloc_len)      seq_len
    |<- owned by the radix tree (locked) ->|                    |                 |
    |<-------------- KV computed and in the pool ------------->|                 |
    |<--------------------- KV slots allocated (page-aligned) --------------->|  |
    a step computes positions [kv_len, kv_len + n); when that reaches seq_len the
    last position's logits give the next token, which is appended to output_ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchrun.params import SamplingParams

PLACEHOLDER = -1  # an output token that is sampled on the device but not yet seen by the host


@dataclass(eq=False, slots=True)
class Req:
    rid: str
    index: int  # which of params.n samples
    input_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int = 0  # admission order tie-breaker
    output_ids: list[int] = field(default_factory=list)
    # KV state (valid while row is not None)
    row: int | None = None
    kv_len: int = 0
    alloc_len: int = 0
    prefix_len: int = 0
    last_node: Any = None
    # a hybrid's prefill chunks end at these token counts, each saved as a state snapshot
    # (ascending, past kv_len; engine/state_snapshots.py)
    snapshot_at: tuple[int, ...] = ()
    penalty_row: int | None = None  # row whose penalty statistics describe this request
    # structured output: an xgrammar GrammarMatcher that has accepted every output token the
    # host has seen (so a retracted request resumes with a valid state)
    matcher: Any = None
    # accounting
    cached_tokens: int | None = None  # prompt tokens served from cache at first admission
    num_retractions: int = 0
    # tokens sampled by launched steps whose ids the host has not seen yet; output_ids holds
    # PLACEHOLDER for them (overlap scheduling), the device has the real ids
    num_inflight: int = 0
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    error: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    budget: Any = None  # engine/thinking.ThinkingBudget with params.max_thinking_tokens
    # engine/thinking.AnswerGate: a grammar request of a thinking model (the fill jobs' own)
    answer_gate: Any = None

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids if self.output_ids else self.input_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without building fill_ids."""
        num_in = len(self.input_ids)
        if start >= num_in:
            return self.output_ids[start - num_in : end - num_in]
        if end <= num_in:
            return self.input_ids[start:end]
        return self.input_ids[start:] + self.output_ids[: end - num_in]

    @property
    def cache_key(self) -> list[int]:
        """What the prefix cache may serve: all tokens but the last, whose logits give the next."""
        return self.tokens(0, self.seq_len - 1)

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens whose KV is still to be computed (1 while decoding)."""
        return self.seq_len - self.kv_len

    @property
    def is_decoding(self) -> bool:
        """Prompt done: each step computes the one newest token."""
        # NOTE: inlined (this and wants_decode are read for every running request every step;
        # the scheduler's _classify repeats the test)
        num_out = len(self.output_ids)
        return (
            num_out > 0
            and self.kv_len + 1 == len(self.input_ids) + num_out
            and self.row is not None
        )

    @property
    def wants_decode(self) -> bool:
        """Decoding and not yet at max_new_tokens (counting tokens still on the device)."""
        return self.is_decoding and len(self.output_ids) < self.params.max_new_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def max_new_remaining(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)
