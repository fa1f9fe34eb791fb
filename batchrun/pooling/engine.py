"""PoolingEngine: prefill-only steps over tokenized sequences, packed by a token budget with no
padding, no decode and no KV kept past a step.

    add([PoolRequest]) ... step() -> [PoolResult] ... while has_work

A step takes the waiting sequences in order until the next would pass `max_step_tokens` (a
sequence longer than the budget runs alone), runs the model once over the packed batch
(pooling/varlen.py) and returns one result per sequence: an embedding, a score, or a head's
logits, as `TaskOptions` says. A causal model's step computes the prefix that consecutive
sequences share once (pooling/shared_prefix.py: a rerank row's instruction + query), where the
task reads the last token only; the budget counts the tokens a step computes. The caller groups
a rerank row's documents by request id."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from batchrun.errors import ModelConfigError
from batchrun.pooling.layout import POOLING_MODES
from batchrun.pooling.model import PoolingModel, TokenRow
from batchrun.pooling.shared_prefix import MIN_SHARED_TOKENS, shared_len

TASKS = ("embed", "rerank", "score", "classify")


@dataclass(frozen=True)
class TaskOptions:
    task: str
    pooling: str | None = None  # None: the model folder's
    normalize: bool | None = None  # None: the folder's Normalize module says
    dimensions: int | None = None  # Matryoshka truncation (then renormalized)
    raw_scores: bool = False  # logits instead of CrossEncoder.predict's sigmoid

    def validate(self, model: PoolingModel) -> None:
        """ModelConfigError naming what to change when the options and the model disagree."""
        if self.task not in TASKS:
            raise ModelConfigError(f"task {self.task!r}; supported: {', '.join(TASKS)}")
        hidden_size = model.hidden_size
        if self.task == "embed":
            if self.pooling is not None and self.pooling not in POOLING_MODES:
                raise ModelConfigError(
                    f"--pooling {self.pooling!r}; supported: {', '.join(POOLING_MODES)}"
                )
            if self.pooling is None and model.spec.pooling is None:
                raise ModelConfigError(
                    "the model folder gives no pooling (no sentence-transformers modules.json "
                    f"with a Pooling module): pass --pooling ({', '.join(POOLING_MODES)})"
                )
            if self.dimensions is not None and not 0 < self.dimensions <= hidden_size:
                raise ModelConfigError(
                    f"--dimensions {self.dimensions}: the model's vectors have {hidden_size} "
                    f"dimensions; give 1 to {hidden_size}"
                )
        elif self.task == "classify" and model.head != "classify":
            raise ModelConfigError(
                "--task classify needs a sequence-classification head (<Arch>ForSequenceClassif"
                "ication); a yes/no reranker gives scores: --task rerank or --task score"
            )
        elif model.head == "base":
            raise ModelConfigError(
                f"--task {self.task} needs a classification head or a yes/no reranker; the model "
                "is a base model (it embeds: --task embed)"
            )


@dataclass(frozen=True)
class PoolRequest:
    rid: Any  # the caller's id of the sequence (a row id, or (row id, document index))
    row: TokenRow


@dataclass(frozen=True)
class PoolResult:
    rid: Any
    value: torch.Tensor  # embed: [D] fp32; score: [] or [L]; classify: logits [L]
    num_tokens: int
    num_shared: int = 0  # of num_tokens: read from a prefix the step computed once


class PoolingEngine:
    def __init__(self, model: PoolingModel, options: TaskOptions, max_step_tokens: int = 16384):
        self.model, self.options, self.max_step_tokens = model, options, max_step_tokens
        self.share = model.shares_prefixes(options.task, options.pooling)
        self.waiting: deque[PoolRequest] = deque()

    def add(self, requests: list[PoolRequest]) -> None:
        self.waiting.extend(requests)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting)

    def _take(self) -> list[PoolRequest]:
        """The next waiting sequences up to the token budget, counting what each computes: a
        prefix it shares with the one before it runs once."""
        batch, tokens, prev = [], 0, None
        while self.waiting:
            ids = self.waiting[0].row.input_ids
            n = len(ids) - (shared_len(prev, ids, MIN_SHARED_TOKENS) if self.share else 0)
            if batch and tokens + n > self.max_step_tokens:
                break
            batch.append(self.waiting.popleft())
            tokens, prev = tokens + n, ids
        return batch

    def step(self) -> list[PoolResult]:
        batch = self._take()
        if not batch:
            return []
        rows, opts, model = [r.row for r in batch], self.options, self.model
        plan = model.plan(rows) if self.share else None
        if opts.task == "embed":
            values = model.embed(rows, opts.pooling, opts.normalize, opts.dimensions, plan)
        elif opts.task == "classify":
            values = model.classify_logits(rows, plan)
        else:
            values = model.scores(rows, opts.raw_scores, plan)
        values = values.cpu()  # NOTE: the one wait per step, on its results
        shared = plan.num_shared if plan is not None else (0,) * len(batch)
        return [
            PoolResult(r.rid, values[i], len(r.row.input_ids), shared[i])
            for i, r in enumerate(batch)
        ]
