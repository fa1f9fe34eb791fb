"""CSV and TSV inputs (``.csv``, ``.tsv``, optionally ``.gz``), streamed with pyarrow's CSV reader.

The first line names the columns. Every column is read as text (no type guessing, so a column
never changes type between blocks), an empty cell is null, and quoted cells may span lines. The
cells of the per-row fields a row needs typed (``max_tokens`` an int, ``temperature`` a float,
``ignore_eos`` a bool, ``stop`` / ``stop_token_ids`` / ``choice`` / ``prompt_token_ids`` a JSON
list, ...; ``CELL_TYPES``) are converted when they parse; a cell that does not stays text, and the
row fails with a message naming the field and the value. A record with the wrong number of cells
is an error row (its record number and text) and the job goes on; a file pyarrow cannot parse
at all fails the input (``count_rows`` reads the whole file before a run starts, so such a file
never half-runs). The row number is the record's index after the header (blank lines skipped).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from batchrun.io.source import BadInputError, DatasetSource, RawRow

CSV_SUFFIXES = (".csv", ".tsv", ".csv.gz", ".tsv.gz")
BLOCK_BYTES = 1 << 20


def _int(text: str) -> Any:
    try:
        return int(text)
    except ValueError:
        value = _float(text)
        return int(value) if isinstance(value, float) and value.is_integer() else text


def _float(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return text


def _bool(text: str) -> Any:
    return {"true": True, "false": False, "1": True, "0": False}.get(text.strip().lower(), text)


def _bool_or_int(text: str) -> Any:
    value = _bool(text)
    return _int(text) if isinstance(value, str) else value


def _json_list(text: str) -> Any:
    if not text.lstrip().startswith("["):
        return text
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text


# The per-row fields of batchrun/io/rows.py that are not text (tests/unit/test_readers.py checks
# that every one of row_fields.ROW_PARAM_FIELDS is here).
CELL_TYPES: dict[str, Callable[[str], Any]] = {
    **dict.fromkeys(
        (
            "max_tokens",
            "max_completion_tokens",
            "min_tokens",
            "top_k",
            "seed",
            "n",
            "top_logprobs",
            "max_thinking_tokens",
        ),
        _int,
    ),
    **dict.fromkeys(
        (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ),
        _float,
    ),
    "ignore_eos": _bool,
    "logprobs": _bool_or_int,
    **dict.fromkeys(("stop", "stop_token_ids", "choice", "prompt_token_ids"), _json_list),
}


class CsvSource(DatasetSource):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        name = path.name.lower()
        self.is_gzip = name.endswith(".gz")
        kind = "tsv" if name.endswith((".tsv", ".tsv.gz")) else "csv"
        self.format = kind + (".gz" if self.is_gzip else "")
        self.delimiter = "\t" if kind == "tsv" else ","
        self.columns = self._header()
        if not self.columns:
            self.num_rows = 0

    def _open(self, columns: list[str], bad: list[tuple[int, str]]) -> Any:
        """A streaming reader; a record with the wrong number of cells is skipped and appended
        to ``bad`` as (row, why), in file order."""
        # local: pyarrow is slow to import; the CLI's option parsing imports this module
        import pyarrow as pa
        import pyarrow.csv as pacsv

        def on_invalid(record: Any) -> str:
            if record.number is None:
                return "error"  # no position to give it: pyarrow fails the input, naming it
            # NOTE: pyarrow numbers records from 1 with the header, blank lines not counted
            row = record.number - 2
            bad.append(
                (
                    row,
                    f"record {row + 1} after the header has {record.actual_columns} cells, the "
                    f"header {record.expected_columns}: {record.text[:200]!r}",
                )
            )
            return "skip"

        stream = pa.input_stream(str(self.path), compression="gzip" if self.is_gzip else None)
        return pacsv.open_csv(
            stream,
            read_options=pacsv.ReadOptions(block_size=BLOCK_BYTES, use_threads=False),
            parse_options=pacsv.ParseOptions(
                delimiter=self.delimiter, newlines_in_values=True, invalid_row_handler=on_invalid
            ),
            convert_options=pacsv.ConvertOptions(
                column_types={c: pa.string() for c in columns},
                strings_can_be_null=True,
                quoted_strings_can_be_null=True,
            ),
        )

    def _header(self) -> list[str]:
        import pyarrow as pa  # local: see _open

        try:
            with self._open([], []) as reader:
                names = reader.schema.names
        except pa.ArrowInvalid as e:
            if "Empty CSV file" in str(e):
                return []
            raise self._bad(e) from e
        except (OSError, EOFError) as e:
            raise self._bad(e) from e
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise BadInputError(
                f"{self.path}: the header names columns {duplicates} more than once; give every "
                "column its own name"
            )
        return names

    def _record_batches(self, bad: list[tuple[int, str]]) -> Iterator[Any]:
        import pyarrow as pa  # local: see _open

        if not self.columns:
            return
        try:
            with self._open(self.columns, bad) as reader:
                yield from reader
        except (pa.ArrowInvalid, OSError, EOFError) as e:
            raise self._bad(e) from e

    def _bad(self, e: Exception) -> BadInputError:
        separator = "tab" if self.delimiter == "\t" else "comma"
        return BadInputError(
            f"{self.path}: not a readable {self.format} file: {e}; quote a cell that holds the "
            f"separator ({separator}), a quote or a line break"
        )

    def count_rows(self) -> int:
        """Records after the header: one pass over the file, nothing converted to Python."""
        bad: list[tuple[int, str]] = []
        return sum(batch.num_rows for batch in self._record_batches(bad)) + len(bad)

    def iter_batches(self, batch_size: int = 1024) -> Iterator[list[RawRow]]:
        typed = [(c, CELL_TYPES[c]) for c in self.columns or () if c in CELL_TYPES]
        bad: list[tuple[int, str]] = []  # filled by pyarrow as it parses, in file order
        k = 0  # bad[:k] are yielded
        row = 0
        for record_batch in self._record_batches(bad):
            for start in range(0, record_batch.num_rows, batch_size):
                batch: list[RawRow] = []
                for data in record_batch.slice(start, batch_size).to_pylist():
                    # a skipped record takes its place among the good ones (by record number)
                    while k < len(bad) and bad[k][0] == row:
                        batch.append(RawRow(row, None, bad[k][1], "invalid_csv"))
                        k, row = k + 1, row + 1
                    for column, convert in typed:
                        text = data[column]
                        if text is not None:
                            data[column] = convert(text)
                    batch.append(RawRow(row, data, None))
                    row += 1
                yield batch
        if k < len(bad):
            yield [RawRow(r, None, why, "invalid_csv") for r, why in bad[k:]]
