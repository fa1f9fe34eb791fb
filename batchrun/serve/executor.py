"""The queue's one worker: takes the oldest unfinished batch and moves it on, one at a time.

    validating --(file checks)--> in_progress --(run)--> finalizing --> completed
        \\--> failed (errors with line numbers)    \\--> cancelling --> cancelled
                                                 \\--> expired (completion_window passed)

Each state is in the store before its work starts, and each step can run again: killed at any
moment and started again, the worker takes the batch it was on first and continues it (a run
resumes from its manifest; finalizing rewrites the same output files). The run itself is the
backend's (local.py: the engine of this box; slurm.py: an array job). On shutdown the run drains,
commits and stays in_progress for the next start.
"""

from __future__ import annotations

import threading
import time
import traceback

from batchrun.serve.config import Layout, ServeConfig
from batchrun.serve.finalize import finalize
from batchrun.serve.store import Store
from batchrun.serve.validate import validate_input

IDLE_WAIT_S = 1.0  # the worker's wait for a new batch, also how often queued expiry is seen


class BatchFailed(Exception):
    """The batch cannot run (its model does not load, its run fails): it ends as failed."""


class Executor:
    def __init__(self, config: ServeConfig, store: Store, layout: Layout, backend):
        self.config, self.store, self.layout, self.backend = config, store, layout, backend
        self.current: str | None = None  # the batch being worked on
        self.reason: str | None = None  # why its run stops: cancel | expire | shutdown
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="batchrun-serve", daemon=True)

    def start(self) -> Executor:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Drain the running batch (it commits and stays in_progress), then stop the worker."""
        self._stopping = True
        self.request_stop(self.current, "shutdown")
        self._wake.set()
        self._thread.join()
        self.backend.close()

    def wake(self) -> None:
        self._wake.set()

    def request_stop(self, batch_id: str | None, reason: str) -> None:
        """Stop the batch's run (it drains and commits); the backend reads the reason back
        through the callable it runs with, so a stop that comes before its run starts holds."""
        if batch_id is not None and batch_id == self.current and self.reason is None:
            self.reason = reason
            self.backend.stop()

    def live_counts(self, batch_id: str) -> dict | None:
        return self.backend.live_counts() if batch_id == self.current else None

    # -- the loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping:
            taken = self.store.take_next()
            if taken is None:
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            batch, owner = taken
            self.current, self.reason = batch["id"], None
            try:
                self._process(batch, owner)
            except Exception as e:  # a bug (or a full disk) fails its batch, not the server
                traceback.print_exc()
                self._fail_anyway(batch["id"], owner, f"internal error: {e}")
            finally:
                self.current = None

    def _fail_anyway(self, batch_id: str, owner: str, message: str) -> None:
        """Failed, with the rows done if their files can be made, else without files."""
        try:
            self._end(batch_id, owner, "failed", message)
        except Exception:
            traceback.print_exc()
            error = {"code": "batch_failed", "message": message, "param": None, "line": None}
            self.store.update_batch(
                batch_id, status="failed", failed_at=int(time.time()),
                errors={"object": "list", "data": [error]},
            )  # fmt: skip

    def _process(self, batch: dict, owner: str) -> None:
        batch_id, status = batch["id"], batch["status"]
        if status == "validating":
            batch = self._validate(batch)
            if batch["status"] == "failed":
                return
            status = batch["status"]
        if status == "cancelling":
            self._end(batch_id, owner, "cancelled")
            return
        if status == "in_progress":
            if time.time() >= batch["expires_at"]:
                self._end(batch_id, owner, "expired")
                return
            status = self._run(batch, owner)
            if status is None:  # shutdown: stays in_progress
                return
        if status in ("finalizing", "expired", "cancelled"):
            self._end(batch_id, owner, "completed" if status == "finalizing" else status)

    def _validate(self, batch: dict) -> dict:
        path = self.layout.file_path(batch["input_file_id"])
        endpoint = batch["endpoint"]
        checked = validate_input(path, endpoint, self.config.model_names)
        now = int(time.time())
        if not checked.ok:
            return self.store.update_batch(
                batch["id"],
                only_if=("validating",),
                status="failed",
                failed_at=now,
                errors={"object": "list", "data": checked.errors},
                request_counts={"total": checked.total, "completed": 0, "failed": 0},
            )
        return self.store.update_batch(
            batch["id"],
            only_if=("validating",),
            status="in_progress",
            in_progress_at=now,
            model=checked.model,
            request_counts={"total": checked.total, "completed": 0, "failed": 0},
        )

    def _run(self, batch: dict, owner: str) -> str | None:
        """Run the batch; the status it goes to next (None: shutdown, it stays in_progress)."""
        batch_id = batch["id"]
        timer = threading.Timer(
            max(0.0, batch["expires_at"] - time.time()),
            self.request_stop,
            (batch_id, "expire"),
        )
        timer.daemon = True
        timer.start()
        try:
            if self.store.get_batch(batch_id)["status"] == "cancelling":
                self.reason = "cancel"
            if self._stopping:
                return None
            finished = self.backend.run(batch, lambda: self.reason)
        except BatchFailed as e:
            self._end(batch_id, owner, "failed", str(e))
            return "failed"
        finally:
            timer.cancel()
        if finished:
            self.store.update_batch(
                batch_id, only_if=("in_progress", "cancelling"), status="finalizing",
                finalizing_at=int(time.time()),
            )  # fmt: skip
            return "finalizing"
        return {"cancel": "cancelled", "expire": "expired"}.get(self.reason or "shutdown")

    def _end(self, batch_id: str, owner: str, status: str, message: str | None = None) -> None:
        """The batch's last step: its output files (the rows done) and its final status."""
        outcome = finalize(self.store, self.layout, batch_id, owner)
        now = int(time.time())
        batch = self.store.get_batch(batch_id)
        counts = dict(batch.get("request_counts") or {"total": 0})
        counts.update(completed=outcome.completed, failed=outcome.failed)
        fields = {
            "status": status,
            f"{status}_at": now,
            "output_file_id": outcome.output_file_id,
            "error_file_id": outcome.error_file_id,
            "request_counts": counts,
            "usage": outcome.usage,
        }
        if status == "cancelled" and not batch.get("cancelling_at"):
            fields["cancelling_at"] = now
        if message is not None:
            fields["errors"] = {
                "object": "list",
                "data": [{"code": "batch_failed", "message": message, "param": None, "line": None}],
            }
        self.store.update_batch(batch_id, **fields)
        for file_id in self.store.unused_deleted_files():
            self.layout.file_path(file_id).unlink(missing_ok=True)
