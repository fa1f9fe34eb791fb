"""The Slurm backend (--executor slurm): a batch runs as an array job of jobs/batchrun-array.sbatch
(one shard per task, requeued and resumed as the script does), tracked with squeue, checked and
merged with `batchrun merge` when its last task ends.

The job id is in the store before the server waits on it, so a restarted server tracks the same
job (it never submits a batch twice). Cancel and expiry: scancel, then the batch's output is
the rows its shards committed. Shutdown leaves the job running.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable

from batchrun.io.manifest import read_manifest
from batchrun.job.merge import MergeError, merge_run
from batchrun.params import SamplingParams
from batchrun.serve.config import Layout, ServeConfig
from batchrun.serve.executor import BatchFailed
from batchrun.serve.finalize import run_dirs
from batchrun.serve.store import Store

GONE_POLLS = 2  # polls in a row that list no task of the job: it has ended
CANCEL_POLLS = 60  # after scancel, polls until the tasks are gone (then the batch ends anyway)
SLURM_TIMEOUT_S = 60


class SlurmBackend:
    def __init__(self, config: ServeConfig, layout: Layout, store: Store):
        self.config, self.layout, self.store = config, layout, store
        self.options = config.slurm
        self._wake = threading.Event()
        self._counts: dict | None = None  # the running batch's, summed over its shards

    def run(self, batch: dict, stop_reason: Callable[[], str | None]) -> bool:
        """True when every row is done and merged; False when stopped (the job is cancelled
        for cancel and expiry, left running for shutdown)."""
        self._wake.clear()
        batch_id = batch["id"]
        job = self.store.executor_state(batch_id).get("job")
        if job is None:
            if stop_reason() is not None:
                return False
            job = self._submit(batch)
            self.store.set_executor_state(batch_id, {"job": job})
        gone = 0
        while gone < GONE_POLLS:
            reason = stop_reason()
            if reason == "shutdown":
                return False
            if reason is not None:
                self._cancel(job)
                return False
            gone = gone + 1 if not self._tasks(job) else 0
            self._counts = self._committed(batch_id)
            self._wake.wait(self.options.poll_s)
        self._counts = None
        try:
            report = merge_run(self.layout.run_dir(batch_id))
        except MergeError as e:
            raise BatchFailed(f"Slurm job {job} ended without output: {e}") from e
        if not report.ok:
            raise BatchFailed(f"Slurm job {job} ended incomplete:\n{report.text()}")
        return True

    def stop(self) -> None:
        self._wake.set()

    def live_counts(self) -> dict | None:
        return self._counts

    def progress_url(self) -> str | None:
        return None  # the tasks run elsewhere: their progress is their logs

    def _committed(self, batch_id: str) -> dict:
        """Rows the shards committed so far (read once a poll, so a GET reads no file)."""
        completed = failed = 0
        for d in run_dirs(self.layout.run_dir(batch_id)):
            try:
                manifest = read_manifest(d)
            except ValueError:
                continue
            if manifest is not None:
                completed += manifest.counts.rows_ok
                failed += manifest.counts.rows_failed
        return {"completed": completed, "failed": failed}

    def close(self) -> None:
        pass

    # -- Slurm's commands ----------------------------------------------------------------------

    def _submit(self, batch: dict) -> str:
        opts, run = self.options, self.layout.run_dir(batch["id"])
        run.mkdir(parents=True, exist_ok=True)
        model = self.config.model_path(batch["model"])
        argv = [
            "sbatch", "--parsable", f"--array=0-{opts.tasks - 1}", f"--chdir={run}",
            f"--job-name=batchrun-{batch['id']}", f"--output={run}/slurm-%A_%a.log",
            *opts.sbatch_args, opts.script,
            str(self.layout.file_path(batch["input_file_id"])), str(run),
            "--served-model-name", batch["model"], *(("--model", model) if model else ()),
            # a row without max_tokens gets the local executor's default (--slurm-submit-arg wins)
            "--max-tokens", str(SamplingParams().max_new_tokens), *opts.submit_args,
        ]  # fmt: skip
        env = {**os.environ, "BATCHRUN": opts.batchrun}
        r = _run(argv, env)
        if r.returncode != 0:
            raise BatchFailed(f"sbatch failed: {(r.stderr or r.stdout).strip()}")
        return r.stdout.strip().split(";")[0]

    def _tasks(self, job: str) -> list[str]:
        """The job's tasks that Slurm still lists (pending, running, requeued, completing)."""
        r = _run(["squeue", "-h", "-j", job, "-o", "%T"])
        if r.returncode != 0:
            if "Invalid job id" in r.stderr:
                return []
            return ["UNKNOWN"]  # slurmctld busy or away: ask again
        return r.stdout.split()

    def _cancel(self, job: str) -> None:
        _run(["scancel", job])
        gone = 0
        for _ in range(CANCEL_POLLS):
            gone = gone + 1 if not self._tasks(job) else 0
            if gone >= GONE_POLLS:
                return
            time.sleep(self.options.poll_s)


def _run(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=SLURM_TIMEOUT_S, env=env
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return subprocess.CompletedProcess(argv, 1, "", str(e))
