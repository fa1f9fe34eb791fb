"""Input rows of a pooling task -> tokenized rows (pooling/row_tokens.py says how a row reads), as
the job's RowPipeline does for generate, in tokenizer worker processes where the job has them.

    reader ── batches of raw rows ──▶ workers (spawned, each loads the tokenizer once)
                                      │ up to 2 batches per worker in flight
    engine ◀── rows, in input order ──┘ while the engine steps, the workers tokenize ahead

The workers start with the engine (TokenizerPool, while the model loads); until one has started
(and with 0 workers) the job's process tokenizes. Either way the seconds spent tokenizing and
the seconds the job waited on it are counted: the summary says whether the tokenizer or the
engine bounds the run (job_engine.py `notes`). A row that cannot run (no such column, an empty
text, a pair without its document, longer than the model with --no-truncate) becomes a RowError
naming its row number and why; the job goes on."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import get_context

from batchrun.io.readers import DatasetSource
from batchrun.io.rows import RowError, RowSpec, detect_openai_batch
from batchrun.io.source import RawRow
from batchrun.job.pipeline import read_rows
from batchrun.pooling.job_options import PoolingJobOptions
from batchrun.pooling.model import PoolingModel
from batchrun.pooling.row_tokens import (
    PoolingRow,
    RowConverter,
    RowRecipe,
    convert_batch,
    warm,
    watch_parent,
)


def default_tokenizer_workers() -> int:
    """Half the cores this process may use, at most 8; none below 4 cores (the reader, the
    engine's host work and the writer keep the rest)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    return 0 if cores < 4 else min(8, cores // 2)


class TokenizerPool:
    """`num_workers` spawned processes (no CUDA state crosses), each loading the model folder's
    tokenizer as it starts; None of them with 0 workers."""

    def __init__(self, model_dir: str, num_workers: int | None) -> None:
        self.num_workers = default_tokenizer_workers() if num_workers is None else num_workers
        self.executor: ProcessPoolExecutor | None = None
        self.warming: list[Future] = []
        if self.num_workers:
            self.executor = ProcessPoolExecutor(
                self.num_workers, get_context("spawn"), watch_parent, (os.getpid(),)
            )
            self.warming = [self.executor.submit(warm, model_dir) for _ in range(self.num_workers)]

    @property
    def is_ready(self) -> bool:
        """A worker has started and loaded its tokenizer."""
        return any(f.done() for f in self.warming)

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
            self.executor = None


class PoolingRows:
    def __init__(self, source: DatasetSource, spec: RowSpec, options: PoolingJobOptions,
                 model: PoolingModel, limit: int | None, batch_size: int, model_dir: str,
                 pool: TokenizerPool) -> None:  # fmt: skip
        self.source, self.spec, self.options, self.model = source, spec, options, model
        self.limit, self.batch_size, self.pool = limit, batch_size, pool
        self.num_workers = pool.num_workers
        width = options.dimensions or model.hidden_size
        scalar = model.head == "lm" or len(model.labels) == 1
        self.recipe = RowRecipe(options, spec, model_dir, model.max_len, model.kind, model.head,
                                width, scalar)  # fmt: skip
        self.num_truncated = 0  # rows cut to max_seq_length
        self.openai: bool | None = None  # OpenAI Batch input (known from the first parsed row)
        self.unseen_columns: set[str] = set()  # (the runner's warning about kept columns)
        self.num_tokens = 0  # tokens of the rows converted
        self.tokenize_s = 0.0  # seconds spent tokenizing (summed over the workers)
        self.wait_s = 0.0  # seconds the job waited on tokenization

    def __iter__(self) -> Iterator[PoolingRow | RowError]:
        batches = read_rows(self.source, self.limit, self.batch_size)
        executor = self.pool.executor
        converter = RowConverter(self.recipe, self.model.tokenizer)
        pending: deque[Future] = deque()
        try:
            for batch in batches:
                self._detect(batch)
                if executor is None or (not pending and not self.pool.is_ready):
                    # no workers, or none started yet: this process tokenizes (in order: nothing
                    # is pending), so the engine's first steps do not wait on the workers' start
                    yield from self._count(self._convert(converter, batch))
                    continue
                pending.append(executor.submit(convert_batch, self.recipe, batch,
                                               bool(self.openai)))  # fmt: skip
                while len(pending) > 2 * self.num_workers:
                    yield from self._collect(pending.popleft())
            while pending:
                yield from self._collect(pending.popleft())
        finally:
            for future in pending:  # a stopped run: what was not taken is not needed
                future.cancel()

    def _convert(self, converter: RowConverter, batch: list[RawRow]) -> list:
        start = time.perf_counter()
        out = [converter.convert(raw, bool(self.openai)) for raw in batch]
        elapsed = time.perf_counter() - start
        self.tokenize_s += elapsed
        self.wait_s += elapsed
        return out

    def _detect(self, batch: list[RawRow]) -> None:
        if self.openai is None:
            first = next((raw.data for raw in batch if raw.data is not None), None)
            if first is not None:
                self.openai = detect_openai_batch(first)

    def _collect(self, future: Future) -> Iterator[PoolingRow | RowError]:
        start = time.perf_counter()
        out, seconds = future.result()
        self.wait_s += time.perf_counter() - start
        self.tokenize_s += seconds
        return self._count(out)

    def _count(self, out: list[PoolingRow | RowError]) -> Iterator[PoolingRow | RowError]:
        for item in out:
            if isinstance(item, PoolingRow):
                self.num_truncated += any(t.truncated for t in item.token_rows)
                self.num_tokens += sum(len(t.input_ids) for t in item.token_rows)
            yield item

    def truncation_note(self) -> str:
        return (
            f"{self.num_truncated:,} rows of this attempt were longer than the model's "
            f"{self.model.max_len} tokens and were cut as sentence-transformers cuts them "
            "(--no-truncate makes them row errors)"
        )
