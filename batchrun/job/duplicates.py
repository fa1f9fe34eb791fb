"""Rows whose id repeats an earlier row's, found while the input streams by.

An id is what a row gives itself: the --id-column value, an "id" field, or an OpenAI Batch
``custom_id`` (rows without one are known by their row number, which never repeats). The first
row with an id runs; each later one becomes a ``duplicate_id`` error that names the first. Every
pass over the input (each resumed attempt, each shard, ``plan``) starts a new set and reads from
the first row, so all of them find the same duplicates and name the same first rows. The set
(batchrun/io/id_set.py) keeps 16 bytes a slot, 2 GiB for 100M ids.

OpenAI Batch input is refused as a whole when ids repeat (the service rejects such a file): a
pass before the model loads (pipeline.openai_duplicates) decodes nothing but the custom_ids.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from batchrun.io.id_set import IdSet
from batchrun.io.readers import RawRow
from batchrun.io.rows import RowError, RowSpec, given_id

OPENAI_ID = "custom_id"


def id_field(spec: RowSpec, openai: bool) -> str | None:
    """Where rows give their id: custom_id, the --id-column, or None (an "id" field)."""
    return OPENAI_ID if openai else spec.id_column


class DuplicateIds:
    """The ids of the rows read so far; `check` says which rows of a batch repeat one."""

    def __init__(self, spec: RowSpec) -> None:
        self.spec = spec
        self.ids = IdSet()
        self.num_duplicates = 0

    def repeats(self, batch: list[RawRow], openai: bool) -> list[tuple[int, str, int]]:
        """(position in batch, id, first row) of each row of `batch` whose id came before."""
        column = id_field(self.spec, openai)
        ids, rows, where = [], [], []
        for i, raw in enumerate(batch):
            row_id = given_id(raw.data, column) if raw.data is not None else None
            if row_id is not None:
                ids.append(row_id)
                rows.append(raw.row)
                where.append(i)
        if not ids:
            return []
        first = self.ids.add(ids, rows)
        found = [(where[k], ids[k], int(first[k])) for k in np.flatnonzero(first >= 0).tolist()]
        self.num_duplicates += len(found)
        return found

    def check(self, batch: list[RawRow], openai: bool) -> list[RowError | None]:
        """For each row, in order: a duplicate_id error, or None (a new id, or no id)."""
        column = id_field(self.spec, openai)
        out: list[RowError | None] = [None] * len(batch)
        for i, row_id, first in self.repeats(batch, openai):
            out[i] = duplicate_error(row_id, batch[i].row, first, column)
        return out


def duplicate_error(row_id: str, row: int, first: int, column: str | None) -> RowError:
    name = column or "id"
    return RowError(
        row_id,
        row,
        "duplicate_id",
        f"row {row}: {name} {row_id!r} repeats row {first} ({name} {row_id!r}), which runs "
        "under it; give every row its own id",
    )


@dataclass
class OpenAIDuplicates:
    """Requests of an OpenAI Batch input whose custom_id repeats an earlier one's."""

    count: int = 0
    examples: list[tuple[str, int, int]] = field(default_factory=list)  # (id, first row, row)

    def message(self, dataset: str) -> str:
        shown = "; ".join(f"{i!r} in rows {a} and {b}" for i, a, b in self.examples)
        more = (
            f"; and {self.count - len(self.examples)} more"
            if self.count > len(self.examples)
            else ""
        )
        return (
            f"{dataset}: OpenAI Batch input needs a unique custom_id per request, and "
            f"{self.count} request(s) repeat an earlier one's: {shown}{more} (rows count from 0, "
            "a JSONL file's line is row + 1); give each request its own custom_id"
        )


def find_repeats(batches: Iterable[list[RawRow]], show: int = 10) -> OpenAIDuplicates | None:
    """The rows of OpenAI Batch input whose custom_id repeats an earlier row's (None: none)."""
    found = OpenAIDuplicates()
    seen = DuplicateIds(RowSpec())
    for batch in batches:
        for i, row_id, first_row in seen.repeats(batch, openai=True):
            if len(found.examples) < show:
                found.examples.append((row_id, first_row, batch[i].row))
        found.count = seen.num_duplicates
    return found if found.count else None
