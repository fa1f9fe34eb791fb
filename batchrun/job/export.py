"""`batchrun export OUT`: a run's records as one file, in input order, each with its input row.

    index the committed records (export_index.py: row, sample index, where the line is)
    -> sort by (row, sample index)
    -> stream the input as the manifest names it (its identity checked against the fingerprint)
       and merge: input row r gets its records, read back by offset, with "input": the row
    -> one JSONL or Parquet file (export_writer.py), renamed into place when complete

Memory: the index (28 bytes a record) and one batch of rows; never a whole results file or the
whole input. Error records are rows like the others: ``error`` ({"type", "message"}) is set and
the completion fields are null; a result's ``error`` is null. A row with n > 1 samples gives n
rows (``index`` 0..n-1). ``OUT`` is a run directory (a run, a shard, or a sharded run's
``merged/``; a sharded run's top directory exports its ``merged/``). Only what the manifest
commits is exported, so a running or interrupted run exports its committed rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np

from batchrun.io.manifest import Manifest, read_manifest
from batchrun.io.readers import BadInputError, DatasetSource, open_dataset
from batchrun.io.stdin import input_identity_of_spool
from batchrun.job.export_index import DamagedRecordError, RecordIndex, committed_lines
from batchrun.job.export_writer import KEEP, ExportFile, InputTypes, record_fields
from batchrun.job.merge import MERGED_DIR, shard_dirs
from batchrun.job.pipeline import read_rows
from batchrun.job.resume import input_identity, normalize
from batchrun.pooling.vector_export import export_vectors, vector_files

FORMATS = ("parquet", "jsonl")
SORTS = ("row", "none")
_decode = msgspec.json.decode


class ExportError(Exception):
    def __init__(self, message: str, exit_code: int = 3) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class ExportReport:
    run_dir: Path
    status: str = ""
    output: Path | None = None
    fmt: str = ""
    sort: str = "row"
    num_results: int = 0
    num_errors: int = 0
    num_rows: int = 0  # input rows with records
    input_path: str | None = None  # joined from
    rows_without_record: int = 0
    notes: list[str] = field(default_factory=list)

    def text(self) -> str:
        order = "input order (row, then sample index)" if self.sort == "row" else "file order"
        lines = [
            f"export       {self.run_dir} ({self.status}) -> {self.output} ({self.fmt})",
            f"records      {self.num_results + self.num_errors:,} "
            f"({_n(self.num_results, 'result')}, {_n(self.num_errors, 'error')}) "
            f"of {_n(self.num_rows, 'input row')}; {order}",
        ]
        if self.input_path is not None:
            line = f"input        joined from {self.input_path}"
            if self.rows_without_record:
                line += (
                    f"; {self.rows_without_record:,} input rows have no record here (another "
                    "shard's, or not committed yet)"
                )
            lines.append(line)
        else:
            lines.append("input        not joined (--no-input)")
        lines += [f"note         {n}" for n in self.notes]
        return "\n".join(lines)


def _n(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def export_run(
    out: str | Path,
    fmt: str | None = None,
    sort: str = "row",
    with_input: bool = True,
    output: str | Path | None = None,
) -> ExportReport:
    out = Path(out)
    if sort == "none" and with_input:
        raise ExportError(
            "--sort none writes the records in the run's file order, where the input cannot be "
            "joined without holding it; use --sort row (input order), or add --no-input",
            exit_code=2,
        )
    run_dir, manifest, report = _resolve(out)
    if fmt is None:
        fmt = "jsonl" if output is not None and str(output).endswith(".jsonl") else "parquet"
    path = Path(output) if output is not None else out / f"export.{fmt}"
    report.fmt, report.sort, report.output = fmt, sort, path
    if vector_files(manifest):  # an embed run: its vectors, in input order
        if fmt != "parquet":
            raise ExportError("an embed run's vectors export as Parquet only", exit_code=2)
        report.num_results = report.num_rows = export_vectors(run_dir, manifest, path)
        return report
    files = [f for f in manifest.files if f.path.startswith(("results-", "errors-"))]
    if _is_openai(run_dir, files):
        raise ExportError(
            f"{run_dir} holds OpenAI Batch output: one line per request with its custom_id, "
            "already the shape the Batch API returns; join it to the input on custom_id"
        )
    source = _input(manifest) if with_input else None
    try:
        index = RecordIndex(run_dir, files)
    except (DamagedRecordError, OSError) as e:  # a listed file that is missing or unreadable
        raise ExportError(f"{run_dir} is damaged: {e}", exit_code=1) from e
    try:
        order = _order(index, sort)
        _count(index, report)
        rows = _joined(index, order, source, manifest, report) if source else _records(index, order)
        writer = _open_writer(path, fmt, index, source, manifest, run_dir, files)
        try:
            writer.write(rows)
            writer.close()
        except BaseException:
            writer.abort()
            raise
    except ValueError as e:
        raise ExportError(str(e), exit_code=1) from e
    except BadInputError as e:  # the input stops parsing (a truncated gzip file)
        raise ExportError(f"cannot read the run's input: {e}") from e
    finally:
        index.close()
    if source is not None:
        report.input_path = str(source.path)
    return report


def _resolve(out: Path) -> tuple[Path, Manifest, ExportReport]:
    if not out.is_dir():
        raise ExportError(f"{out} is not a directory")
    run_dir = out
    try:
        manifest = read_manifest(out)
        if manifest is None and (out / MERGED_DIR).is_dir():
            run_dir = out / MERGED_DIR
            manifest = read_manifest(run_dir)
    except ValueError as e:
        raise ExportError(str(e)) from e
    if manifest is None:
        if shard_dirs(out):
            raise ExportError(
                f"{out} is a sharded run without merged/: run batchrun merge {out} first, or "
                f"export one shard ({out}/shard-0)"
            )
        raise ExportError(f"{out} has no manifest.json: not a batchrun run directory")
    report = ExportReport(run_dir, status=manifest.status)
    if not manifest.is_complete:
        report.notes.append(
            f"the run is {manifest.status}: its {manifest.ledger_rows:,} committed rows are "
            "exported"
        )
    return run_dir, manifest, report


def _is_openai(run_dir: Path, files) -> bool:
    for line in committed_lines(run_dir, files):
        try:
            record = _decode(line)
        except msgspec.DecodeError:
            return False  # the index names the damage
        return isinstance(record, dict) and "custom_id" in record and "response" in record
    return False


def _input(manifest: Manifest) -> DatasetSource:
    """The run's input, as the manifest names it, checked to be the content the run read."""
    path = Path(manifest.input.path)
    hint = "export without it: --no-input"
    if not path.exists():
        raise ExportError(f"the run's input {path} is not there; put it back, or {hint}")
    try:
        source = open_dataset(path, manifest.input.split)
        expected = manifest.fingerprint.get("input")
        if expected:
            if expected.get("stdin"):
                found = input_identity_of_spool(path)
            else:
                found = input_identity(path, source.format, manifest.input.split)
            if normalize(found) != normalize(expected):
                raise ExportError(
                    f"the run's input {path} changed since the run (size or content), so its "
                    f"rows would not match the records; restore it, or {hint}"
                )
    except (BadInputError, OSError) as e:
        raise ExportError(f"cannot read the run's input: {e}; {hint}") from e
    return source


def _order(index: RecordIndex, sort: str) -> np.ndarray:
    if sort != "row":
        return np.arange(len(index))
    order = index.sorted_order()
    duplicates = index.duplicates(order)
    if len(duplicates):
        shown = ", ".join(str(r) for r in duplicates[:10].tolist())
        raise ExportError(
            f"{index.run_dir}: rows committed more than once ({shown}); the directory is "
            "damaged (check it with batchrun inspect / batchrun merge)",
            exit_code=1,
        )
    return order


def _count(index: RecordIndex, report: ExportReport) -> None:
    errors = [i for i, f in enumerate(index.files) if f.path.startswith("errors-")]
    is_error = np.isin(index.file, errors)
    report.num_errors = int(is_error.sum())
    report.num_results = len(index) - report.num_errors
    report.num_rows = int(np.unique(index.row).size)


def _records(index: RecordIndex, order: np.ndarray) -> Iterator[tuple[bytes, object]]:
    for _, line in index.lines(order):
        yield line, KEEP


def _joined(
    index: RecordIndex,
    order: np.ndarray,
    source: DatasetSource,
    manifest: Manifest,
    report: ExportReport,
) -> Iterator[tuple[bytes, object]]:
    """Merge of the sorted records with the input rows (both by row number): (record line,
    the whole input row; None where it did not parse)."""
    records = index.lines(order)
    row, line = next(records, (None, b""))
    for batch in read_rows(source, manifest.config.get("limit"), 1024):
        for raw in batch:
            if row is not None and row < raw.row:
                raise _no_such_row(row, source)
            if row != raw.row:
                report.rows_without_record += 1
                continue
            while row == raw.row:
                yield line, raw.data
                row, line = next(records, (None, b""))
    if row is not None:
        raise _no_such_row(row, source)


def _no_such_row(row: int, source: DatasetSource) -> ValueError:
    return ValueError(
        f"a record has row {row}, which the input {source.path} does not have (with the run's "
        "--limit); the run was made from another input"
    )


def _open_writer(path, fmt, index, source, manifest, run_dir, files) -> ExportFile:
    if fmt != "parquet":
        return ExportFile(path, fmt)
    import pyarrow as pa  # local: only Parquet needs it

    fields = record_fields(index.has_index, index.has_token_ids, index.has_logprobs)
    as_json: frozenset[str] = frozenset()
    if source is not None and source.arrow_schema is not None:
        input_type = pa.struct(list(source.arrow_schema))
    elif source is not None:  # JSON / CSV rows: a first pass over the input for the types
        types = InputTypes()
        for batch in read_rows(source, manifest.config.get("limit"), 4096):
            types.add([r.data for r in batch if r.data is not None])
        input_type, as_json = types.struct()
    elif manifest.config.get("spec", {}).get("keep_columns"):  # the records' own "input"
        types = InputTypes()
        decode_input = msgspec.json.Decoder(_Input).decode
        kept: list[dict] = []
        for line in committed_lines(run_dir, files):
            value = decode_input(line).input
            if value is not None:
                kept.append(value)
            if len(kept) >= 4096:
                types.add(kept)
                kept = []
        types.add(kept)
        input_type, as_json = types.struct()
    else:
        input_type = None
    if input_type is not None and input_type.num_fields:
        fields.append(pa.field("input", input_type))
    return ExportFile(path, fmt, pa.schema(fields), as_json)


class _Input(msgspec.Struct):
    input: dict | None = None
