"""Rows from a dataset to tokenized requests: the part `submit` and `plan` share.

source.iter_batches -> duplicate ids (a row whose id an earlier row has fails as duplicate_id)
-> prepare_row (id, prompt | messages, per-row params) -> tokenize_rows
yields TokenizedRow or RowError; every pass reads the input from its first row.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from batchrun.io.readers import DatasetSource, RawRow
from batchrun.io.rows import (
    PreparedRow,
    RowError,
    RowSpec,
    detect_openai_batch,
    kept_columns,
    prepare_row,
)
from batchrun.job.duplicates import OPENAI_ID, DuplicateIds, OpenAIDuplicates, find_repeats
from batchrun.job.tokenize import TokenizedRow, tokenize_rows
from batchrun.params import SamplingParams


def read_rows(
    source: DatasetSource, limit: int | None, batch_size: int, field: str | None = None
) -> Iterator[list[RawRow]]:
    """Batches of raw rows, stopping after `limit` rows (never reads further than needed); with
    `field`, each row's data holds only that field."""
    seen = 0
    batches = (
        source.iter_batches(batch_size) if field is None else source.iter_field(field, batch_size)
    )
    for batch in batches:
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
    duplicates: DuplicateIds | None = field(default=None, init=False)  # of the pass under way
    vocab_size: int | None = None  # the model's: bounds pre-tokenized rows' ids
    # --keep-columns no row read so far has (checked until every one is seen)
    unseen_columns: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.unseen_columns = set(self.spec.keep_columns)

    def __iter__(self) -> Iterator[TokenizedRow | RowError]:
        self.duplicates = DuplicateIds(self.spec)
        for raw_batch in read_rows(self.source, self.limit, self.batch_size):
            if self.openai is None:
                first = next((r.data for r in raw_batch if r.data is not None), None)
                if first is not None:
                    self.openai = detect_openai_batch(first)
            repeats = self.duplicates.check(raw_batch, bool(self.openai))
            if self.unseen_columns:
                for raw in raw_batch:
                    if raw.data is not None:
                        self.unseen_columns -= raw.data.keys()
            prepared: list[PreparedRow] = []
            for raw, repeat in zip(raw_batch, repeats, strict=True):
                if repeat is None:
                    item = prepare_row(raw, self.spec, self.defaults, bool(self.openai))
                else:
                    item = repeat._replace(kept=kept_columns(raw.data, self.spec.keep_columns))
                if isinstance(item, RowError):
                    yield item
                else:
                    prepared.append(item)
            yield from tokenize_rows(
                self.tokenizer, prepared, self.spec, self.context_len, self.vocab_size
            )


def openai_duplicates(
    source: DatasetSource, limit: int | None, show: int = 10
) -> OpenAIDuplicates | None:
    """The repeated custom_ids of OpenAI Batch input; None when there are none or the input is
    not OpenAI Batch (known from its first row that parses: other inputs cost one batch)."""
    first = None
    for batch in read_rows(source, limit, 64):
        first = next((r.data for r in batch if r.data is not None), None)
        if first is not None:
            break
    if first is None or not detect_openai_batch(first):
        return None
    return find_repeats(read_rows(source, limit, 8192, field=OPENAI_ID), show)
