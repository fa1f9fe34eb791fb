"""Rows from a dataset to tokenized requests: the part `submit` and `plan` share.

source.iter_batches -> prepare_row (id, prompt | messages, per-row params) -> tokenize_rows
yields TokenizedRow or RowError, in input order within a batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from batchrun.io.readers import DatasetSource, RawRow
from batchrun.io.rows import PreparedRow, RowError, RowSpec, detect_openai_batch, prepare_row
from batchrun.job.tokenize import TokenizedRow, tokenize_rows
from batchrun.params import SamplingParams


def read_rows(source: DatasetSource, limit: int | None, batch_size: int) -> Iterator[list[RawRow]]:
    """Batches of raw rows, stopping after `limit` rows (never reads further than needed)."""
    seen = 0
    for batch in source.iter_batches(batch_size):
        if limit is not None and seen + len(batch) > limit:
            batch = batch[: limit - seen]
        seen += len(batch)
        if batch:
            yield batch
        if limit is not None and seen >= limit:
            return


@dataclass
class RowPipeline:
    source: DatasetSource
    spec: RowSpec
    defaults: SamplingParams
    tokenizer: object
    context_len: int
    limit: int | None = None
    batch_size: int = 256
    openai: bool | None = None  # decided from the first row that parses
    vocab_size: int | None = None  # the model's: bounds pre-tokenized rows' ids
    # --keep-columns no row read so far has (checked until every one is seen)
    unseen_columns: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.unseen_columns = set(self.spec.keep_columns)

    def __iter__(self) -> Iterator[TokenizedRow | RowError]:
        for raw_batch in read_rows(self.source, self.limit, self.batch_size):
            if self.openai is None:
                first = next((r.data for r in raw_batch if r.data is not None), None)
                if first is not None:
                    self.openai = detect_openai_batch(first)
            if self.unseen_columns:
                for raw in raw_batch:
                    if raw.data is not None:
                        self.unseen_columns -= raw.data.keys()
            prepared: list[PreparedRow] = []
            for raw in raw_batch:
                item = prepare_row(raw, self.spec, self.defaults, bool(self.openai))
                if isinstance(item, RowError):
                    yield item
                else:
                    prepared.append(item)
            yield from tokenize_rows(
                self.tokenizer, prepared, self.spec, self.context_len, self.vocab_size
            )
