"""What goes into the engine and what comes out of it.

These are msgspec Structs because they cross process boundaries (engine process, writer) and end
up in output files; `omit_defaults=True` keeps encoded messages and records small.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf", "choice")


class GrammarSpec(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """What a request's output must match (structured output). Hashable: the compile cache key.

    spec by kind: json_schema: the schema as JSON text (key order kept: it is the field order of
    the output); json_object: empty (any JSON object); regex: the pattern; ebnf: the grammar
    (GBNF-style, root rule `root`); choice: a JSON list of the allowed strings.
    """

    kind: str
    spec: str = ""


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """Per-request sampling options. Semantics follow OpenAI / vLLM where they overlap."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style: over prompt and output tokens
    frequency_penalty: float = 0.0  # OpenAI style: over output tokens, scaled by count
    presence_penalty: float = 0.0  # OpenAI style: over output tokens, once
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None  # None: the engine derives one from the request id
    n: int = 1
    logprobs: bool = False  # logprob of each chosen token
    top_logprobs: int = 0  # and the N most likely tokens at each step
    grammar: GrammarSpec | None = None  # structured output: the output must match it
    # thinking budget: after this many reasoning tokens the engine ends the thinking block the
    # model's own way and the answer follows (engine/thinking.py); None: no budget
    max_thinking_tokens: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def validate(
        self, vocab_size: int | None = None, names: Mapping[str, str] | None = None
    ) -> None:
        """Raise ValueError with a message that says what to change. ``names`` maps a field to
        what the caller's user wrote for it (a CLI option, a row field); the field name else."""
        name = (lambda f: names.get(f, f)) if names else (lambda f: f)
        if self.max_new_tokens < 1:
            raise ValueError(f"{name('max_new_tokens')} must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"{name('min_new_tokens')} must be between 0 and {name('max_new_tokens')} "
                f"({self.max_new_tokens}), got {self.min_new_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"{name('temperature')} must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"{name('top_p')} must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"{name('top_k')} must be -1 (disabled) or >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"{name('min_p')} must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(
                f"{name('repetition_penalty')} must be > 0, got {self.repetition_penalty}"
            )
        for field in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, field)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name(field)} must be in [-2, 2], got {value}")
        if self.n < 1:
            raise ValueError(f"{name('n')} must be >= 1, got {self.n}")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"{name('top_logprobs')} must be in [0, 20], got {self.top_logprobs}")
        if self.max_thinking_tokens is not None and self.max_thinking_tokens < 1:
            raise ValueError(
                f"{name('max_thinking_tokens')} must be >= 1, got {self.max_thinking_tokens} "
                "(to skip thinking, turn it off in the template: chat_template_kwargs "
                '{"enable_thinking": false})'
            )
        if any(not s for s in self.stop):
            raise ValueError(f"{name('stop')}: a stop string must not be empty")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"{name('stop_token_ids')} must be in [0, {vocab_size}), got {bad[0]}"
                )
        if self.grammar is not None and self.grammar.kind not in GRAMMAR_KINDS:
            raise ValueError(
                f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.grammar.kind!r}"
            )


class GenerateRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """One prompt as token ids. With params.n > 1 it yields n results (index 0..n-1).

    input_ids: a list (or tuple) of ints in [0, vocab size), checked by check_input_ids where
    the engine takes the request."""

    rid: str
    input_ids: list[int]
    params: SamplingParams = SamplingParams()


@functools.lru_cache(maxsize=8)
def _ids_type(vocab_size: int) -> Any:
    return list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]]


def check_input_ids(rid: str, input_ids: Any, vocab_size: int) -> list[int]:
    """`input_ids` as a new list, or a ValueError naming the request, what was passed (its type,
    the bad value and its position) and what is expected.

    NOTE: one msgspec pass checks every element's type (int, not bool or float) and range and
    makes the copy the engine keeps: 1M tokens take 11-22 ms on this repository's 2-core CI
    machine, against 6 ms for the plain list() copy it replaces."""
    try:
        ids = msgspec.convert(input_ids, _ids_type(vocab_size))
    except msgspec.ValidationError as e:
        problem = _describe(input_ids, str(e), vocab_size)
        raise ValueError(
            f"request {rid!r}: input_ids must be a list of token ids (ints in [0, {vocab_size})); "
            f"{problem}"
        ) from None
    if not ids:
        raise ValueError(
            f"request {rid!r}: input_ids must be a list of token ids with at least one; got an "
            "empty one"
        )
    return ids


def _describe(value: Any, error: str, vocab_size: int) -> str:
    """What is wrong with `value`, from msgspec's `error` ("... - at `$[3]`" for an element)."""
    at = re.search(r"at `\$\[(\d+)\]", error)
    if at is None:
        return _describe_container(value)
    i = int(at.group(1))
    item = value[i]
    kind = type(item).__name__
    if isinstance(item, int) and not isinstance(item, bool):
        return f"input_ids[{i}] is {item}, outside the vocabulary [0, {vocab_size})"
    if isinstance(item, (list, tuple)):
        return (
            f"input_ids[{i}] is a {kind}: a request holds one sequence of token ids, not a "
            "batch (one GenerateRequest per sequence)"
        )
    hint = "; convert with .tolist()" if hasattr(item, "tolist") else ""
    return f"input_ids[{i}] is {item!r} ({kind}){hint}"


def _describe_container(value: Any) -> str:
    kind = type(value).__name__
    if hasattr(value, "keys"):
        keys = ", ".join(repr(k) for k in list(value.keys())[:4])
        return (
            f'got a {kind} with keys {keys}: pass its ["input_ids"], or tokenize with '
            "tokenizer.apply_chat_template(..., return_dict=False)"
        )
    if isinstance(value, (str, bytes)):
        return (
            f"got a {kind} ({value[:40]!r}): tokenize it first, e.g. with "
            "tokenizer.apply_chat_template(messages, add_generation_prompt=True, "
            "return_dict=False)"
        )
    if hasattr(value, "tolist"):
        return f"got a {kind}: pass a flat list, e.g. input_ids.tolist()"
    return f"got a {kind}"


class TopLogprobs(msgspec.Struct, frozen=True, omit_defaults=True):
    token_ids: list[int]
    logprobs: list[float]


class GenerateResult(msgspec.Struct, omit_defaults=True):
    """One finished completion."""

    rid: str
    output_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    index: int = 0  # which of the n samples
    matched_stop: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    error: str | None = None  # why an aborted request could not run


class EngineCounters(msgspec.Struct, frozen=True, omit_defaults=True):
    """An engine's progress as the job sees it: cumulative counts since the engine started and
    the gauges of the moment. Cheap (a few ints), so the engine process sends it with every
    `Results` message and an in-process engine builds it after every step."""

    num_steps: int = 0
    num_forward_tokens: int = 0
    forward_time: float = 0.0  # seconds the device spent in forward passes
    generated_tokens: int = 0  # output tokens sampled and seen by the host, finished or not
    admitted_tokens: int = 0  # prompt tokens of requests at their first admission
    admitted_cached_tokens: int = 0  # of which served from the prefix cache
    num_running: int = 0
    num_waiting: int = 0  # queued, or compiling a grammar
    kv_used: int = 0  # KV slots held by running requests (not free, not evictable cache)
    kv_total: int = 0  # KV slots in the pool

    def __add__(self, other: EngineCounters) -> EngineCounters:
        """Field-wise sum (data parallel: the engines together)."""
        return EngineCounters(
            *(a + b for a, b in zip(msgspec.structs.astuple(self), msgspec.structs.astuple(other)))
        )

    def since(self, base: EngineCounters) -> EngineCounters:
        """The counts since `base` was taken, with the gauges of now (an engine that ran
        before: a job's counts start from its own start)."""
        if base == _NO_COUNTS:
            return self
        return msgspec.structs.replace(
            self,
            num_steps=self.num_steps - base.num_steps,
            num_forward_tokens=self.num_forward_tokens - base.num_forward_tokens,
            forward_time=self.forward_time - base.forward_time,
            generated_tokens=self.generated_tokens - base.generated_tokens,
            admitted_tokens=self.admitted_tokens - base.admitted_tokens,
            admitted_cached_tokens=self.admitted_cached_tokens - base.admitted_cached_tokens,
        )


_NO_COUNTS = EngineCounters()
