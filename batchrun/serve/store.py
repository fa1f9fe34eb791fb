"""The server's state in SQLite (stdlib sqlite3, WAL): files, batches and the queue.

A batch row holds the OpenAI batch object as JSON (the API's view) plus the columns the queue
needs: ``seq`` (first in, first out), ``status``, ``started`` (the executor took it) and
``executor`` (the executor's own state, e.g. a Slurm job id). Every change is one transaction:
killed at any moment, the file holds the state of the last change that returned.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, deleted INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, owner TEXT NOT NULL,
    status TEXT NOT NULL, started INTEGER NOT NULL DEFAULT 0, data TEXT NOT NULL,
    executor TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS batches_owner ON batches (owner, seq);
CREATE INDEX IF NOT EXISTS files_owner ON files (owner, created_at);
"""

# statuses that end a batch; every other one is still the executor's to move on
FINAL = ("completed", "failed", "expired", "cancelled")
FILE_COLUMNS = ("id", "owner", "purpose", "filename", "bytes", "created_at")


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class Store:
    """One connection shared by the HTTP loop and the executor thread, behind a lock (every
    statement is short: one row by primary key, or one page of a list)."""

    def __init__(self, path: Path):
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # a returned change survives a crash
            self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- files -------------------------------------------------------------------------------

    def add_file(self, file_id: str, owner: str, purpose: str, filename: str, size: int) -> dict:
        row = (file_id, owner, purpose, filename, size, int(time.time()))
        with self._lock:
            self._db.execute(
                "INSERT INTO files (id, owner, purpose, filename, bytes, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                row,
            )
        return dict(zip(FILE_COLUMNS, row, strict=True))

    def put_file(self, file_id: str, owner: str, purpose: str, filename: str, size: int) -> None:
        """Add or replace a file the server made (a batch's output: finalizing again replaces)."""
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO files (id, owner, purpose, filename, bytes, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (file_id, owner, purpose, filename, size, int(time.time())),
            )

    def get_file(self, file_id: str, owner: str | None) -> dict | None:
        """The file, if `owner` (None: any) created it and it is not deleted."""
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM files WHERE id = ? AND deleted = 0", (file_id,)
            ).fetchone()
        if row is None or (owner is not None and row["owner"] != owner):
            return None
        return {k: row[k] for k in FILE_COLUMNS}

    def list_files(self, owner: str, purpose: str | None, after: str | None, limit: int):
        query, args = "SELECT * FROM files WHERE owner = ? AND deleted = 0", [owner]
        if purpose:
            query, args = query + " AND purpose = ?", [*args, purpose]
        if after:
            query += " AND rowid > (SELECT rowid FROM files WHERE id = ?)"
            args.append(after)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY rowid LIMIT ?", [*args, limit + 1])
            rows = rows.fetchall()
        return [{k: r[k] for k in FILE_COLUMNS} for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str, owner: str) -> bool:
        with self._lock:
            cur = self._db.execute(
                "UPDATE files SET deleted = 1 WHERE id = ? AND owner = ? AND deleted = 0",
                (file_id, owner),
            )
        return cur.rowcount == 1

    def unused_deleted_files(self) -> list[str]:
        """Deleted files whose content no unfinished batch still reads."""
        marks = ",".join("?" * len(FINAL))
        with self._lock:
            rows = self._db.execute(
                "SELECT id FROM files WHERE deleted = 1 AND id NOT IN (SELECT json_extract(data, "
                f"'$.input_file_id') FROM batches WHERE status NOT IN ({marks}))",
                FINAL,
            ).fetchall()
        return [r["id"] for r in rows]

    # -- batches -----------------------------------------------------------------------------

    def add_batch(self, batch: dict, owner: str) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO batches (id, owner, status, data) VALUES (?, ?, ?, ?)",
                (batch["id"], owner, batch["status"], json.dumps(batch)),
            )

    def get_batch(self, batch_id: str, owner: str | None = None) -> dict | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None or (owner is not None and row["owner"] != owner):
            return None
        return json.loads(row["data"])

    def list_batches(self, owner: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """Newest first, as OpenAI lists them; `after` is the last id of the previous page."""
        query, args = "SELECT data FROM batches WHERE owner = ?", [owner]
        if after:
            query += " AND seq < (SELECT seq FROM batches WHERE id = ?)"
            args.append(after)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY seq DESC LIMIT ?", [*args, limit + 1])
            rows = rows.fetchall()
        return [json.loads(r["data"]) for r in rows[:limit]], len(rows) > limit

    def update_batch(self, batch_id: str, only_if: tuple[str, ...] = (), **fields: Any) -> dict:
        """Set fields of the batch object (status also sets its column); with `only_if`, only
        while the status is one of those. Returns the batch as it is after the call."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute(
                    "SELECT status, data FROM batches WHERE id = ?", (batch_id,)
                ).fetchone()
                batch = json.loads(row["data"])
                if not only_if or row["status"] in only_if:
                    batch.update(fields)
                    self._db.execute(
                        "UPDATE batches SET status = ?, data = ? WHERE id = ?",
                        (batch["status"], json.dumps(batch), batch_id),
                    )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return batch

    def cancel_batch(self, batch_id: str, owner: str) -> tuple[dict | None, bool]:
        """Cancel: a batch the executor has not taken ends at once (cancelled); a taken one goes
        to cancelling (the executor stops it). Returns (batch, whether the executor must act)."""
        now = int(time.time())
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute(
                    "SELECT * FROM batches WHERE id = ? AND owner = ?", (batch_id, owner)
                ).fetchone()
                if row is None:
                    self._db.execute("COMMIT")
                    return None, False
                batch = json.loads(row["data"])
                act = False
                if row["status"] not in FINAL and row["status"] != "cancelling":
                    if row["started"]:
                        batch.update(status="cancelling", cancelling_at=now)
                        act = True
                    else:
                        batch.update(status="cancelled", cancelling_at=now, cancelled_at=now)
                    self._db.execute(
                        "UPDATE batches SET status = ?, data = ? WHERE id = ?",
                        (batch["status"], json.dumps(batch), batch_id),
                    )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return batch, act

    def take_next(self) -> tuple[dict, str] | None:
        """The oldest unfinished batch and its owner (taken ones first: a restart continues
        what it was doing), marked as taken."""
        marks = ",".join("?" * len(FINAL))
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute(
                    f"SELECT id, owner, data FROM batches WHERE status NOT IN ({marks}) "
                    "ORDER BY started DESC, seq LIMIT 1",
                    FINAL,
                ).fetchone()
                if row is not None:
                    self._db.execute("UPDATE batches SET started = 1 WHERE id = ?", (row["id"],))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return None if row is None else (json.loads(row["data"]), row["owner"])

    def count_batches(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) AS n FROM batches GROUP BY status")
            return {r["status"]: r["n"] for r in rows.fetchall()}

    def executor_state(self, batch_id: str) -> dict:
        with self._lock:
            row = self._db.execute(
                "SELECT executor FROM batches WHERE id = ?", (batch_id,)
            ).fetchone()
        return json.loads(row["executor"]) if row is not None else {}

    def set_executor_state(self, batch_id: str, state: dict) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE batches SET executor = ? WHERE id = ?", (json.dumps(state), batch_id)
            )
