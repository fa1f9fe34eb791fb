"""The file `export` writes: JSON Lines or Parquet, written to a temp file and renamed into place.

A Parquet file needs its schema before the first row. The record's columns are fixed (as
batchrun/io/records.py writes them); the ``input`` struct's fields are the input's Parquet /
datasets schema, or, for JSON and CSV rows, inferred by ``InputTypes`` from a first pass over the
values (types unified as pyarrow promotes them: null -> any, int -> float; a field whose values
cannot share one type, e.g. ``1`` and ``"x"``, becomes a JSON-text column). Rows then go to
pyarrow's ``ParquetWriter`` in batches of ``BATCH_ROWS``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.io.writer import fsync_dir

BATCH_ROWS = 4096
KEEP = object()  # in place of an input row: the record keeps its own "input" (or none)
_INPUT_KEY = b'"input":'
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.decode


def record_fields(has_index: bool, has_token_ids: bool, has_logprobs: bool) -> list[pa.Field]:
    """The columns of a result / error record (an error row has only row, id and error)."""
    pair = [("token_id", pa.int64()), ("logprob", pa.float64())]
    fields = [pa.field("row", pa.int64()), pa.field("id", pa.string())]
    if has_index:
        fields.append(pa.field("index", pa.int64()))
    fields += [
        pa.field("text", pa.string()),
        pa.field("finish_reason", pa.string()),
        pa.field(
            "usage",
            pa.struct(
                [(k, pa.int64()) for k in ("prompt_tokens", "completion_tokens", "cached_tokens")]
            ),
        ),
    ]
    if has_token_ids:
        fields.append(pa.field("token_ids", pa.list_(pa.int64())))
    if has_logprobs:
        top = pa.list_(pa.struct(pair))
        fields.append(pa.field("logprobs", pa.list_(pa.struct([*pair, ("top", top)]))))
    fields.append(pa.field("error", pa.struct([("type", pa.string()), ("message", pa.string())])))
    return fields


class InputTypes:
    """The Arrow type of each input column over a stream of rows (first seen, first listed)."""

    def __init__(self) -> None:
        self.types: dict[str, pa.DataType | None] = {}  # None: values of several types (JSON)

    def add(self, rows: list[dict]) -> None:
        names: dict[str, None] = {}
        for data in rows:
            names.update(dict.fromkeys(data))
        for name in names:
            if name in self.types and self.types[name] is None:
                continue
            try:
                found = pa.array([data.get(name) for data in rows]).type
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
                self.types[name] = None
                continue
            self.types[name] = _unify(self.types[name], found) if name in self.types else found

    def struct(self) -> tuple[pa.DataType | None, frozenset[str]]:
        """(the input struct, None without columns; the columns written as JSON text)."""
        fields = [(n, pa.string() if t is None else t) for n, t in self.types.items()]
        as_json = frozenset(n for n, t in self.types.items() if t is None)
        return (pa.struct(fields) if fields else None), as_json


def _unify(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    try:
        schemas = [pa.schema([("f", a)]), pa.schema([("f", b)])]
        return pa.unify_schemas(schemas, promote_options="permissive").field("f").type
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return None


class ExportFile:
    """(record line, input row or KEEP) pairs to ``path``: JSONL lines, or Parquet with the given
    schema; the input row becomes the record's "input". Nothing is at ``path`` until ``close()``
    renames the finished temp file there; ``abort()`` deletes it."""

    def __init__(
        self, path: Path, fmt: str, schema: pa.Schema | None = None, as_json=frozenset()
    ) -> None:
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp")
        self.fmt = fmt
        self.as_json = as_json  # input columns written as JSON text (Parquet)
        self.num_rows = 0
        self._batch: list[tuple[bytes, Any]] = []
        if fmt == "parquet":
            self.schema = schema
            self._parquet = pq.ParquetWriter(self.tmp, schema)
        else:
            self._jsonl = open(self.tmp, "wb")

    def write(self, rows: Iterable[tuple[bytes, Any]]) -> None:
        for row in rows:
            self._batch.append(row)
            if len(self._batch) >= BATCH_ROWS:
                self._flush()

    def _flush(self) -> None:
        pairs, self._batch = self._batch, []
        if not pairs:
            return
        self.num_rows += len(pairs)
        if self.fmt != "parquet":
            self._jsonl.write(b"".join(_jsonl_line(line, data) for line, data in pairs))
            return
        batch = []
        for line, data in pairs:
            record = _decode(line)
            if data is not KEEP:
                record["input"] = data
            data = record.get("input")
            if data and self.as_json:
                record["input"] = {
                    k: _as_json(v) if k in self.as_json else v for k, v in data.items()
                }
            batch.append(record)
        try:
            table = pa.Table.from_pylist(batch, schema=self.schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
            raise ValueError(
                f"row {batch[0].get('row')}..{batch[-1].get('row')} does not fit the Parquet "
                f"schema ({e}); export with --format jsonl"
            ) from e
        self._parquet.write_table(table)

    def close(self) -> None:
        self._flush()
        if self.fmt == "parquet":
            self._parquet.close()
        else:
            self._jsonl.close()
        with open(self.tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        try:
            if self.fmt == "parquet":
                self._parquet.close()
            else:
                self._jsonl.close()
        finally:
            self.tmp.unlink(missing_ok=True)


def _jsonl_line(line: bytes, data: Any) -> bytes:
    if data is KEEP:
        return line + b"\n"
    if _INPUT_KEY not in line:  # NOTE: the common case: splice, no decode (a record is "{...}")
        return line[:-1] + b"," + _INPUT_KEY + _encode(data) + b"}\n"
    record = _decode(line)  # kept columns: the whole row replaces them
    record["input"] = data
    return _encode(record) + b"\n"


def _as_json(value: Any) -> str | None:
    return None if value is None else _encode(value).decode()
