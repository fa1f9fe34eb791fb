"""What goes into the engine and what comes out of it.

These are msgspec Structs because they cross process boundaries (engine process, writer) and end
up in output files; `omit_defaults=True` keeps encoded messages and records small.
"""

from __future__ import annotations

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

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError with a message that says what to change."""
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size})")
        if self.grammar is not None and self.grammar.kind not in GRAMMAR_KINDS:
            raise ValueError(
                f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.grammar.kind!r}"
            )


class GenerateRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """One prompt as token ids. With params.n > 1 it yields n results (index 0..n-1)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams = SamplingParams()


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
