"""A run directory and its commit protocol: results / errors shards, row ledger, manifest.

    add_result / add_error (buffered) --commit()--> append + fsync shards, append + fsync ledger,
                                                    fsync dir (new files), replace manifest.json

``manifest.json`` is replaced atomically last, so it is the commit: whatever it lists (files with
their committed rows and bytes, ``ledger_rows`` committed input rows, counts) is the run's
committed state, at every instant. A kill -9 anywhere leaves at most uncommitted bytes past those
lengths; ``open`` (the resume) cuts them off, reports it, and returns the committed row numbers so
the runner skips those rows and runs the rest. A row enters the ledger in the same commit as its
records and is never added twice, so no row is ever committed twice. Committed bytes that are
gone (a file cut or deleted outside batchrun) are found at ``open`` by their sizes; the rows that
lost records run again (job/salvage.py), whether or not the run was complete.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np

from batchrun.errors import RunError
from batchrun.io.manifest import MANIFEST_NAME, Counts, Manifest, read_manifest, write_manifest
from batchrun.io.stdin import SPOOL_NAMES
from batchrun.io.writer import (
    DamagedRunError,
    RowLedger,
    ShardedWriter,
    ShardFile,
    fsync_dir,
)
from batchrun.job.resume import fingerprint_diff
from batchrun.job.salvage import find_damage, salvage
from batchrun.pooling.vector_shard import write_vectors

OUR_FILES = (
    "results-",
    "errors-",
    ".results-",
    ".errors-",
    "vectors-",
    RowLedger.NAME,
    MANIFEST_NAME,
    *SPOOL_NAMES,
)


class RunOutput:
    def __init__(self, out: Path, manifest: Manifest, shard_size: int) -> None:
        self.out = out
        self.manifest = manifest
        files = manifest.files
        self.results = ShardedWriter(out, "results", shard_size, _with_prefix(files, "results-"))
        self.errors = ShardedWriter(out, "errors", shard_size, _with_prefix(files, "errors-"))
        self.ledger = RowLedger(out, manifest.ledger_rows)
        # embed runs: one Parquet file of (id, embedding) per commit that has vectors
        self.vector_files = _with_prefix(files, VECTORS_PREFIX)
        self.embedding_dtype = "float32"
        self._vector_ids: list[str] = []
        self._vector_rows: list[int] = []
        self._vectors: list[np.ndarray] = []
        self.notes: list[str] = []  # what a resume repaired
        self._committed = np.zeros(0, dtype=bool)  # bitmap over row numbers committed before
        self.last_commit = time.monotonic()

    # -- opening: fresh, resumed or complete -----------------------------------------------------

    @classmethod
    def open(cls, out: Path, fresh: Manifest, shard_size: int, overwrite: bool) -> RunOutput:
        """The run in ``out``: a new one (``fresh``), or the committed state of the same run
        (same fingerprint) repaired for resuming. Raises RunError with what to do otherwise."""
        try:
            return cls._open(out, fresh, shard_size, overwrite)
        except DamagedRunError as e:
            raise RunError(f"cannot resume {out}: {e}; pass --overwrite to start over") from e
        except OSError as e:
            raise RunError(f"cannot prepare --out {out}: {e}") from e

    @classmethod
    def _open(cls, out: Path, fresh: Manifest, shard_size: int, overwrite: bool) -> RunOutput:
        if out.exists() and not out.is_dir():
            raise RunError(f"--out {out} exists and is not a directory")
        if overwrite and out.is_dir():
            for p in out.iterdir():
                if p.is_file() and p.name.startswith(OUR_FILES):
                    p.unlink()
        out.mkdir(parents=True, exist_ok=True)
        try:
            old = read_manifest(out)
        except ValueError as e:
            raise RunError(str(e)) from e
        if old is None:
            # a spooled standard input can precede the first manifest (a run killed in between)
            foreign = [
                p.name
                for p in out.iterdir()
                if not p.name.startswith(".") and p.name not in SPOOL_NAMES
            ]
            if foreign:
                raise RunError(
                    f"--out {out} already holds files ({', '.join(sorted(foreign)[:3])}, ...) but "
                    "no batchrun manifest; choose another directory or pass --overwrite"
                )
            return cls(out, fresh, shard_size)
        if not old.fingerprint:
            raise RunError(
                f"--out {out} holds a run of batchrun {old.batchrun_version}, which cannot be "
                "resumed; choose another directory or pass --overwrite to replace it"
            )
        diff = fingerprint_diff(old.fingerprint, fresh.fingerprint)
        if diff:
            raise RunError(
                f"--out {out} already holds a different run; what differs: {'; '.join(diff)}. "
                "Run the original command to resume it, choose another --out, or pass "
                "--overwrite to replace it"
            )
        # committed records that are gone (a file cut or deleted outside batchrun): their rows
        # leave the committed state and run again, also in a run that was complete
        damage = find_damage(out, old)
        salvaged = salvage(out, old, damage) if damage else []
        run = cls(out, old, shard_size)
        run.notes += salvaged
        if not old.is_complete:
            run._repair()
        return run

    def _repair(self) -> None:
        self.notes += self.results.repair() + self.errors.repair() + self._repair_vectors()
        rows = self.ledger.repair()
        if len(rows):
            self._committed = np.zeros(int(rows.max()) + 1, dtype=bool)
            self._committed[rows] = True
        if self.notes:
            fsync_dir(self.out)

    def _repair_vectors(self) -> list[str]:
        """Vector files no commit lists (a kill between their write and the manifest) go."""
        listed = {f.path for f in self.vector_files}
        notes = []
        for p in sorted(self.out.iterdir()):
            if _VECTOR_FILE.match(p.name) and p.name not in listed:
                p.unlink()
                notes.append(f"{p.name}: removed (not committed)")
        return notes

    @property
    def is_complete(self) -> bool:
        return self.manifest.is_complete

    @property
    def num_committed_rows(self) -> int:
        return self.manifest.ledger_rows

    def is_committed(self, row: int) -> bool:
        """Whether a previous attempt committed this input row (skip it)."""
        return row < len(self._committed) and bool(self._committed[row])

    # -- adding and committing --------------------------------------------------------------------

    def add_result(self, row: int, lines: list[bytes]) -> None:
        for line in lines:
            self.results.add(line)
        self.ledger.add(row)

    def add_vector(self, row: int, row_id: str, vector: np.ndarray) -> None:
        """An embed row's vector [D]; it goes into the next commit's vector file."""
        self._vector_ids.append(row_id)
        self._vector_rows.append(row)
        self._vectors.append(vector)
        self.ledger.add(row)

    def add_error(self, row: int, line: bytes) -> None:
        self.errors.add(line)
        self.ledger.add(row)

    @property
    def num_uncommitted(self) -> int:
        return self.ledger.num_pending

    def commit(self, counts: Counts, status: str | None = None, finished: str | None = None):
        """Make everything added so far durable, then replace the manifest (the commit).
        On an OSError (disk full, I/O error) the files are cut back to the last commit and a
        RunError says so; the committed rows stay valid for a resume."""
        m = self.manifest
        committed = ([ShardFile(f.path, f.rows, f.bytes) for f in m.files], m.ledger_rows)
        num_vector_files = len(self.vector_files)
        try:
            created = self.results.commit() | self.errors.commit() | self._commit_vectors()
            self.ledger.commit()
            if created:
                fsync_dir(self.out)
            m.files = list(self.results.files) + list(self.errors.files) + self.vector_files
            m.ledger_rows = self.ledger.committed
            m.counts = counts
            if status is not None:
                m.status = status
            if finished is not None:
                m.finished = finished
            write_manifest(self.out, m)
        except OSError as e:
            m.files, m.ledger_rows = committed
            del self.vector_files[num_vector_files:]
            self._restore(*committed)
            raise RunError(
                f"cannot write to {self.out}: {e.strerror or e}; the run stopped. The "
                f"{committed[1]:,} rows committed before are intact: free space (or fix the "
                "disk) and run the same command again to resume"
            ) from e
        self.last_commit = time.monotonic()

    def _commit_vectors(self) -> bool:
        """Write the buffered vectors as a new file (atomic); whether one was created."""
        if not self._vectors:
            return False
        name = f"{VECTORS_PREFIX}{len(self.vector_files):05d}.parquet"
        path = self.out / name
        vectors = np.stack(self._vectors)
        write_vectors(path, self._vector_ids, vectors, self.embedding_dtype, self._vector_rows)
        self.vector_files.append(ShardFile(name, len(self._vectors), path.stat().st_size))
        self._vector_ids, self._vector_rows, self._vectors = [], [], []
        return True

    def _restore(self, files: list[ShardFile], ledger_rows: int) -> None:
        """Best effort: cut the files back to the last commit (a resume would do it anyway)."""
        try:
            for prefix in ("results-", "errors-"):
                ShardedWriter(self.out, prefix[:-1], 1, _with_prefix(files, prefix)).repair()
            RowLedger(self.out, ledger_rows).truncate()
        except (OSError, DamagedRunError):
            pass

    def close(self) -> None:
        self.results.close()
        self.errors.close()


VECTORS_PREFIX = "vectors-"
_VECTOR_FILE = re.compile(r"^vectors-\d+\.parquet(\.tmp)?$")


def _with_prefix(files: list[ShardFile], prefix: str) -> list[ShardFile]:
    return [f for f in files if f.path.startswith(prefix)]
