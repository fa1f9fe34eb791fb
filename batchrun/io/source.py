"""What every reader yields: ``RawRow``s in batches from a ``DatasetSource``; ``BadInputError``
when an input cannot be read at all. The readers live in batchrun/io/readers.py (JSONL, Parquet,
HF datasets, ``open_dataset``), json_array.py and csv_source.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple


class BadInputError(Exception):
    """The input cannot be read at all. The message says what to do about it."""


class RawRow(NamedTuple):
    row: int  # 0-based row index in the input; for JSONL the line index, so line = row + 1
    data: dict | None  # the parsed row; None when it could not be parsed
    error: str | None  # why it could not be parsed, e.g. "line 7: invalid JSON: ..."
    kind: str = "invalid_json"  # the error record's type when it could not ("invalid_csv")


class DatasetSource:
    """A readable input. ``num_rows`` is None when it is not known without a full pass;
    ``columns`` is None when the input has no schema (JSON rows each have their own keys)."""

    format: str = ""
    num_rows: int | None = None
    columns: list[str] | None = None
    arrow_schema: Any = None  # pyarrow.Schema of a Parquet / datasets input, else None

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def iter_batches(self, batch_size: int = 1024) -> Iterator[list[RawRow]]:
        raise NotImplementedError

    def iter_field(self, name: str, batch_size: int = 8192) -> Iterator[list[RawRow]]:
        """As iter_batches, with a row's data holding only the field `name` (null when absent),
        for a pass that needs one field (JSONL decodes nothing else)."""
        for batch in self.iter_batches(batch_size):
            yield [
                RawRow(r.row, {name: r.data.get(name)} if r.data is not None else None, r.error)
                for r in batch
            ]

    def count_rows(self) -> int:
        """Rows the input holds; for JSONL this is one pass over the file (non-blank lines)."""
        if self.num_rows is not None:
            return self.num_rows
        return sum(len(batch) for batch in self.iter_batches(8192))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(path={str(self.path)!r}, format={self.format!r})"
