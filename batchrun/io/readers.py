"""Stream rows from a dataset without ever loading a whole file.

Supported inputs:

- JSON Lines: ``.jsonl`` / ``.ndjson``, optionally gzip-compressed (``.gz``). One object per line;
  blank lines are skipped but still counted, so ``line = row + 1``. A line that is not valid JSON
  or not a JSON object becomes a ``RawRow`` with ``error`` set and the job goes on.
- Parquet: one ``.parquet`` file or a directory of them (read in sorted path order, row groups
  streamed one record batch at a time).
- JSON: ``.json`` (optionally ``.gz``) holding one array of row objects (batchrun/io/
  json_array.py, streamed) or, when its first character is not ``[``, JSON Lines as above.
- CSV / TSV: ``.csv`` / ``.tsv`` (optionally ``.gz``; batchrun/io/csv_source.py).
- A HuggingFace ``datasets`` directory written by ``save_to_disk`` (a ``Dataset`` or a
  ``DatasetDict``; the latter needs a split), or a ``datasets.Dataset`` / ``DatasetDict`` object.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from batchrun.io.csv_source import CSV_SUFFIXES, CsvSource
from batchrun.io.json_array import JsonArraySource, first_char
from batchrun.io.source import BadInputError, DatasetSource, RawRow

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")
JSON_SUFFIXES = (".json", ".json.gz")
SUPPORTED = (
    ".jsonl, .ndjson, .json (a JSON array or JSON Lines), .csv, .tsv (all optionally .gz), "
    ".parquet, a directory of .parquet files, a HuggingFace datasets directory made by "
    "save_to_disk, or - (JSON Lines on standard input)"
)
_decode = msgspec.json.Decoder().decode


class JsonlSource(DatasetSource):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.is_gzip = path.name.endswith(".gz")
        self.format = "jsonl.gz" if self.is_gzip else "jsonl"
        # An empty plain file is known cheaply; anything else would need a full pass.
        self.num_rows = 0 if not self.is_gzip and path.stat().st_size == 0 else None

    def _open(self) -> Any:
        return gzip.open(self.path, "rb") if self.is_gzip else open(self.path, "rb")

    def count_rows(self) -> int:
        """Non-blank lines, without decoding JSON: what iter_batches will yield."""
        with self._open() as f:
            return sum(1 for line in f if line.strip())

    def _lines(self) -> Iterator[tuple[int, bytes]]:
        """(line index, line) of the non-blank lines: the line index is the row number."""
        index = -1
        with self._open() as f:
            try:
                for index, line in enumerate(f):
                    if index == 0 and line.startswith(b"\xef\xbb\xbf"):
                        line = line[3:]  # a UTF-8 BOM some editors write
                    if line.strip():
                        yield index, line
            except (OSError, EOFError) as e:  # truncated or corrupt gzip stream
                raise BadInputError(
                    f"{self.path}: cannot read past line {index + 1}: {e}; "
                    "the file is truncated or corrupt, re-create or re-download it"
                ) from e

    def iter_batches(self, batch_size: int = 1024) -> Iterator[list[RawRow]]:
        batch: list[RawRow] = []
        for index, line in self._lines():
            batch.append(_parse_line(index, line))
            if len(batch) >= batch_size:
                yield batch
                batch = []
        if batch:
            yield batch

    def iter_field(self, name: str, batch_size: int = 8192) -> Iterator[list[RawRow]]:
        # NOTE: a Struct of one field skips the rest of the line unparsed: ~10x faster than
        # decoding a whole OpenAI Batch request line
        field = msgspec.defstruct("Field", [("value", Any, None)], rename={"value": name})
        decode = msgspec.json.Decoder(field).decode
        batch: list[RawRow] = []
        for index, line in self._lines():
            try:
                batch.append(RawRow(index, {name: decode(line).value}, None))
            except msgspec.DecodeError:  # not JSON, or not an object (a ValidationError)
                batch.append(RawRow(index, None, f"line {index + 1}: not a JSON object"))
            if len(batch) >= batch_size:
                yield batch
                batch = []
        if batch:
            yield batch


def _parse_line(index: int, line: bytes) -> RawRow:
    try:
        value = _decode(line)
    except msgspec.DecodeError as e:
        return RawRow(index, None, f"line {index + 1}: invalid JSON: {e}")
    if not isinstance(value, dict):
        kind = "null" if value is None else type(value).__name__
        return RawRow(index, None, f"line {index + 1}: expected a JSON object, got {kind}")
    return RawRow(index, value, None)


class ParquetSource(DatasetSource):
    format = "parquet"

    def __init__(self, path: Path) -> None:
        # local: pyarrow is slow to import and only Parquet needs it; io.rows imports
        # this module, and through it the CLI's option parsing
        import pyarrow.parquet as pq

        super().__init__(path)
        if path.is_dir():
            # Skip Spark/Hadoop side files (_SUCCESS, _metadata, .crc) and hidden temp files.
            self.files = sorted(
                p
                for p in path.rglob("*.parquet")
                if not any(part.startswith((".", "_")) for part in p.relative_to(path).parts)
            )
        else:
            self.files = [path]
        num_rows = 0
        schemas = []
        for file in self.files:
            try:
                pf = pq.ParquetFile(file)
            except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a broken footer
                raise BadInputError(f"{file}: not a readable Parquet file: {e}") from e
            num_rows += pf.metadata.num_rows
            schemas.append(pf.schema_arrow)
        self.num_rows = num_rows
        self.columns = list(dict.fromkeys(name for schema in schemas for name in schema.names))
        self.arrow_schema = _unified(schemas)

    def iter_batches(self, batch_size: int = 1024) -> Iterator[list[RawRow]]:
        import pyarrow.parquet as pq  # local: see __init__

        row = 0
        for file in self.files:
            # NOTE: ParquetFile.iter_batches decodes one row group at a time, so memory is bounded
            # by the largest row group, never by the file.
            with pq.ParquetFile(file) as pf:
                for record_batch in pf.iter_batches(batch_size=batch_size):
                    rows = record_batch.to_pylist()
                    yield [RawRow(row + i, data, None) for i, data in enumerate(rows)]
                    row += len(rows)


def _unified(schemas: list) -> Any:
    """One schema for the files of a directory (None when their columns' types conflict)."""
    import pyarrow as pa  # local: see ParquetSource

    if not schemas:
        return None
    try:
        return pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None


class HFDatasetSource(DatasetSource):
    format = "hf-datasets"

    def __init__(self, dataset: Any, path: Path | None = None) -> None:
        super().__init__(path)
        self.dataset = dataset
        self.num_rows = len(dataset)
        self.columns = list(dataset.column_names)
        self.arrow_schema = dataset.features.arrow_schema

    def iter_batches(self, batch_size: int = 1024) -> Iterator[list[RawRow]]:
        row = 0
        # Arrow format hands out memory-mapped tables; to_pylist converts one batch at a time.
        for table in self.dataset.with_format("arrow").iter(batch_size=batch_size):
            rows = table.to_pylist()
            yield [RawRow(row + i, data, None) for i, data in enumerate(rows)]
            row += len(rows)


def open_dataset(path: str | Path | Any, split: str | None = None) -> DatasetSource:
    """Open an input for streaming. Raises BadInputError when it cannot be read at all."""
    if not isinstance(path, (str, Path)):
        return _from_datasets_object(path, split, None)
    p = Path(path).expanduser()
    if not p.exists():
        raise BadInputError(f"input not found: {p}; check the path (supported: {SUPPORTED})")
    if p.is_dir():
        if (p / "dataset_dict.json").exists() or (p / "state.json").exists():
            return _load_from_disk(p, split)
        source = ParquetSource(p)
        if not source.files:
            raise BadInputError(
                f"{p} is a directory without .parquet files and is not a datasets directory "
                f"(no dataset_dict.json or state.json); supported inputs: {SUPPORTED}"
            )
        return source
    name = p.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return JsonlSource(p)
    if name.endswith(JSON_SUFFIXES):
        try:
            is_array = first_char(p) == "["
        except (OSError, EOFError) as e:
            raise BadInputError(f"{p}: cannot read: {e}") from e
        return JsonArraySource(p) if is_array else JsonlSource(p)
    if name.endswith(CSV_SUFFIXES):
        return CsvSource(p)
    if name.endswith(".parquet"):
        return ParquetSource(p)
    raise BadInputError(f"unsupported input file {p.name!r}; supported: {SUPPORTED}")


def _load_from_disk(path: Path, split: str | None) -> DatasetSource:
    try:
        import datasets
    except ImportError as e:
        raise BadInputError(
            f"{path} is a HuggingFace datasets directory; install the extra to read it: "
            "pip install 'batchrun[datasets]'"
        ) from e
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises several kinds for a damaged directory
        raise BadInputError(f"{path}: cannot load the datasets directory: {e}") from e
    return _from_datasets_object(ds, split, path)


def _from_datasets_object(obj: Any, split: str | None, path: Path | None) -> DatasetSource:
    try:
        import datasets
    except ImportError as e:
        raise BadInputError(f"cannot read {type(obj).__name__}: `datasets` is missing") from e
    where = str(path) if path is not None else "the DatasetDict"
    if isinstance(obj, datasets.DatasetDict):
        splits = list(obj.keys())
        if split is None:
            if "train" in obj:
                split = "train"
            elif len(splits) == 1:
                split = splits[0]
            else:
                raise BadInputError(
                    f"{where} has splits {splits}; choose one with --split, "
                    f"e.g. --split {splits[0]}"
                )
        if split not in obj:
            raise BadInputError(f"{where} has no split {split!r}; available splits: {splits}")
        obj = obj[split]
    elif split is not None and getattr(obj, "split", None) is not None and str(obj.split) != split:
        raise BadInputError(f"{where} is a single split ({obj.split}); drop --split {split}")
    if not isinstance(obj, datasets.Dataset):
        raise BadInputError(
            f"cannot read a {type(obj).__name__}; pass a path, a datasets.Dataset "
            "or a datasets.DatasetDict"
        )
    return HFDatasetSource(obj, path)
