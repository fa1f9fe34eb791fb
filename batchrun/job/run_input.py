"""The input of a `submit` run: the dataset opened for streaming, or standard input spooled into
the run directory (batchrun/io/stdin.py), and the checks of --keep-columns against it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import BinaryIO

from batchrun.errors import InputError, OptionError
from batchrun.io.readers import BadInputError, DatasetSource, open_dataset
from batchrun.io.rows import RowSpec, detect_openai_batch, schema_problem, show_columns
from batchrun.io.stdin import STDIN, SpooledInput, spool_stdin


class RunInput:
    def __init__(self, dataset: str, split: str | None, out: Path, stdin: BinaryIO | None):
        self.dataset = dataset
        self.split = split
        self.spool: SpooledInput | None = None
        if dataset == STDIN:
            self.spool = spool_stdin(stdin or sys.stdin.buffer, out)
        try:
            self.source = self._open(self.spool.tmp if self.spool is not None else dataset)
        except BaseException:
            self.discard()
            raise

    @property
    def name(self) -> str:
        """The input as messages name it."""
        return "standard input" if self.spool is not None else self.dataset

    @property
    def path(self) -> str:
        """The file the manifest names as the run's input (for `-`: the spool's final name)."""
        path = self.spool.path if self.spool is not None else Path(self.dataset).expanduser()
        return str(path.absolute())

    @property
    def identity(self) -> dict | None:
        """The fingerprint's "input" when it is not the file's (standard input: its content)."""
        return self.spool.identity if self.spool is not None else None

    def accept(self) -> DatasetSource:
        """The run directory took the run: a spool becomes its input file."""
        if self.spool is not None:
            self.source = self._open(self.spool.keep())
        return self.source

    def discard(self) -> None:
        """The run was refused: delete the spool."""
        if self.spool is not None:
            self.spool.discard()

    def _open(self, path: str | Path) -> DatasetSource:
        try:
            return open_dataset(path, self.split)
        except BadInputError as e:
            raise InputError(str(e)) from e

    def check_columns(self, spec: RowSpec) -> None:
        """Refuse, before the model loads, an input whose schema gives no row a prompt or an
        id (rows/schema_problem)."""
        problem = schema_problem(self.source.columns, spec)
        if problem is not None:
            raise InputError(f"{self.name}: {problem}")

    def check_keep_columns(self, keep: tuple[str, ...]) -> list[str]:
        """Refuse --keep-columns for OpenAI Batch input (its output has a fixed shape), before
        the model loads. Returns warnings: the kept columns the input's schema does not have."""
        if not keep:
            return []
        if _is_openai_batch(self.source):
            raise OptionError(
                "--keep-columns does not apply to OpenAI Batch input: its output lines have the "
                "fixed OpenAI shape; join them to the input on custom_id, or drop --keep-columns"
            )
        columns = self.source.columns
        if columns is None:
            return []  # JSON rows: known once every row is read (the pipeline tracks it)
        return [no_column_warning(c, columns) for c in keep if c not in columns]


def _is_openai_batch(source: DatasetSource) -> bool:
    """Whether the first row that parses is an OpenAI Batch request (as RowPipeline decides)."""
    for batch in source.iter_batches(64):
        first = next((r.data for r in batch if r.data is not None), None)
        if first is not None:
            return detect_openai_batch(first)
    return False


def no_column_warning(name: str, columns: list[str] | None) -> str:
    shown = "" if columns is None else f" (the input's columns: {show_columns(columns)})"
    return f"--keep-columns: no row has a column {name!r}{shown}; it is null in every record"
