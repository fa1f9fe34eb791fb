"""The pooling engine behind the job's runner: the interface job/runner.py drives an Engine with
(`add_request`, `step`, `has_work`, `wants_requests`, `drop_waiting`, `counters`), over a
PoolingEngine in this process. A request is one input row: one sequence, or a rerank row's
(query, document) pairs, whose results come back together in the documents' order."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from batchrun.config import EngineConfig
from batchrun.params import EngineCounters
from batchrun.pooling.engine import PoolingEngine, PoolRequest, TaskOptions
from batchrun.pooling.job_options import PoolingJobOptions
from batchrun.pooling.job_rows import TokenizerPool
from batchrun.pooling.model import TokenRow, load_pooling_model

if TYPE_CHECKING:
    from batchrun.pooling.job_rows import PoolingRows

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_STEP_TOKENS = 16384


@dataclass(frozen=True)
class PoolJobRequest:
    rid: str
    token_rows: tuple[TokenRow, ...]


@dataclass(frozen=True)
class PooledRow:
    rid: str
    values: tuple[torch.Tensor, ...]  # one per sequence of the request, in its order
    num_tokens: int
    num_shared: int = 0  # of num_tokens: read from a prefix a step computed once


@dataclass(frozen=True)
class PoolingKernels:
    """What the manifest records of how the steps run (the job writes `kernels`)."""

    task: str
    attention: str  # varlen (CUDA, 16-bit) or sdpa (per sequence)
    max_step_tokens: int
    shared_prefix: bool  # a step computes its sequences' shared prefixes once

    def describe(self) -> str:
        shared = ", shared prefixes once" if self.shared_prefix else ""
        return (
            f"{self.task}: {self.attention} attention, steps of up to {self.max_step_tokens:,} "
            f"tokens{shared}"
        )


class PoolingJobEngine:
    def __init__(self, config: EngineConfig, options: PoolingJobOptions) -> None:
        if config.model is None:
            raise ValueError("--task embed / rerank / score / classify needs --model")
        device = config.device if config.device not in (None, "auto") else (
            "cuda" if torch.cuda.is_available() else "cpu")  # fmt: skip
        # auto: as --dtype says for every task (bfloat16 on CUDA, float32 elsewhere)
        dtype = DTYPES.get(config.dtype, torch.bfloat16 if device == "cuda" else torch.float32)
        self.model_dir = str(Path(config.model).expanduser())
        # the tokenizer workers start (and import) while the model loads
        self.tokenizer_pool = TokenizerPool(self.model_dir, options.tokenizer_workers)
        task = TaskOptions(options.task, options.pooling, options.normalize, options.dimensions,
                           options.raw_scores)  # fmt: skip
        try:
            self.model = load_pooling_model(self.model_dir, dtype, device, config.load_format)
            task.validate(self.model)
        except BaseException:
            self.tokenizer_pool.close()
            raise
        self.max_step_tokens = DEFAULT_STEP_TOKENS
        self.engine = PoolingEngine(self.model, task, self.max_step_tokens)
        self.tokenizer = self.model.tokenizer
        self.context_len = self.model.max_len
        self.vocab_size = len(self.tokenizer)
        attention = "varlen" if device == "cuda" and dtype != torch.float32 else "sdpa"
        self.kernels = PoolingKernels(
            options.task, attention, self.max_step_tokens, self.engine.share
        )
        self._open: dict[str, list] = {}  # rid -> the values so far (None: not yet)
        self._tokens: dict[str, int] = {}
        self._shared: dict[str, int] = {}
        self._num_waiting_tokens = 0
        self._steps = self._forward_tokens = self._rows_in = 0
        self._admitted_tokens = self._shared_tokens = 0
        self._forward_time = 0.0

    @property
    def has_work(self) -> bool:
        return self.engine.has_work

    @property
    def wants_requests(self) -> bool:
        """Room for more rows: a few steps' worth of tokens wait at most."""
        return self._num_waiting_tokens < 4 * self.max_step_tokens

    def add_request(self, request: PoolJobRequest) -> None:
        rows = request.token_rows
        self._open[request.rid] = [None] * len(rows)
        self._tokens[request.rid] = self._shared[request.rid] = 0
        self.engine.add([PoolRequest((request.rid, i), r) for i, r in enumerate(rows)])
        self._num_waiting_tokens += sum(len(r.input_ids) for r in rows)
        self._rows_in += 1

    def step(self) -> list[PooledRow]:
        start = time.perf_counter()
        results = self.engine.step()
        self._forward_time += time.perf_counter() - start
        self._steps += 1
        done = []
        for r in results:
            rid, i = r.rid
            self._num_waiting_tokens -= r.num_tokens
            self._forward_tokens += r.num_tokens - r.num_shared  # what the step computed
            self._admitted_tokens += r.num_tokens
            self._shared_tokens += r.num_shared
            values = self._open[rid]
            values[i] = r.value
            self._tokens[rid] += r.num_tokens
            self._shared[rid] += r.num_shared
            if all(v is not None for v in values):
                del self._open[rid]
                tokens, shared = self._tokens.pop(rid), self._shared.pop(rid)
                done.append(PooledRow(rid, tuple(values), tokens, shared))
        return done

    def drop_waiting(self) -> None:
        """Stop admitting: rows not started leave (a resume runs them); a rerank row already
        partly run finishes."""
        started = {rid for rid, vals in self._open.items() if any(v is not None for v in vals)}
        keep = [r for r in self.engine.waiting if r.rid[0] in started]
        for r in self.engine.waiting:
            if r.rid[0] not in started:
                self._open.pop(r.rid[0], None)
                self._tokens.pop(r.rid[0], None)
                self._shared.pop(r.rid[0], None)
        self.engine.waiting.clear()
        self.engine.waiting.extend(keep)
        self._num_waiting_tokens = sum(len(r.row.input_ids) for r in keep)

    @property
    def counters(self) -> EngineCounters:
        return EngineCounters(
            num_steps=self._steps,
            num_forward_tokens=self._forward_tokens,
            forward_time=self._forward_time,
            admitted_tokens=self._admitted_tokens,
            admitted_cached_tokens=self._shared_tokens,
            num_waiting=len(self._open),
        )

    def notes(self, base: EngineCounters, rows: PoolingRows | None, elapsed_s: float) -> list[str]:
        """The summary's lines about this attempt since `base` (the counters at its start): the
        shared-prefix tokens a step computed once, and the tokenizer's rate against the engine's
        (prompt tokens a second each could sustain alone): the slower one bounds the run."""
        c = self.counters.since(base)
        lines = []
        if c.admitted_cached_tokens:
            lines.append(
                f"shared prefixes: {c.admitted_cached_tokens:,} of {c.admitted_tokens:,} prompt "
                f"tokens ({c.admitted_cached_tokens / c.admitted_tokens:.1%}) computed once for "
                "the sequences that share them (rerank queries, instruction prefixes)"
            )
        if rows is None or not rows.tokenize_s or not c.forward_time:
            return lines
        workers = rows.num_workers
        tokenizer = rows.num_tokens / rows.tokenize_s * max(1, workers)
        engine = c.admitted_tokens / c.forward_time
        who = "worker processes" if workers else "in the job's process"
        bound = "the tokenizer" if tokenizer < engine else "the engine"
        lines.append(
            f"rates: tokenizer {tokenizer:,.0f} tok/s ({workers or 'none:'} {who}), engine "
            f"{engine:,.0f} tok/s; the job waited {rows.wait_s:.1f} s of {elapsed_s:.1f} s on "
            f"tokenization: {bound} bounds this run"
        )
        return lines

    def close(self) -> None:
        self.engine.waiting.clear()
        self.tokenizer_pool.close()
