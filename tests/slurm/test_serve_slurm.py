"""`batchrun serve --executor slurm` on a real local Slurm (scripts/slurm-local.sh start), CPU.

A batch of 450 rows runs as an array job of 3 tasks (jobs/batchrun-array.sbatch). After every
task has committed rows, task 1 is requeued (`scontrol requeue JOB_1`, as a preemption does) and
the server is killed (SIGKILL) and started again: it tracks the same job (no second sbatch),
merges the shards when the job ends, and the batch completes with every custom_id exactly once.
A cancelled batch's job is scancelled; its output holds the rows its shards committed, once.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_server import Server, batch_lines, jsonl, output_lines, wait_batch  # noqa: E402
from test_slurm import PROBLEM, REQUIRED, diagnostics, sh  # noqa: E402
from tiny_models import make_tiny_chat_model  # noqa: E402

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(PROBLEM is not None and not REQUIRED, reason=str(PROBLEM)),
]
NUM_ROWS, NUM_TASKS = 450, 3


@pytest.fixture(autouse=True)
def _cluster_up():
    if PROBLEM is not None:
        pytest.fail(f"BATCHRUN_REQUIRE_SLURM=1 but {PROBLEM}")


def _job_id(data_dir: Path, batch_id: str) -> str | None:
    db = sqlite3.connect(data_dir / "state.db")
    try:
        row = db.execute("SELECT executor FROM batches WHERE id = ?", (batch_id,)).fetchone()
    finally:
        db.close()
    return json.loads(row[0]).get("job") if row else None


def _committed(shard: Path) -> int:
    try:
        return json.loads((shard / "manifest.json").read_text()).get("ledger_rows", 0)
    except (OSError, ValueError):
        return 0


def _wait(what: str, predicate, run: Path, job: str | None, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted(run.glob("slurm-*.log")))
    pytest.fail(f"timed out waiting for {what}\n{diagnostics(run, job) if job else ''}\n{logs}")


SUBMIT = ("--device", "cpu", "--kv-budget", "4096", "--max-running", "1", "--ignore-eos",
          "--commit-every", "5", "--drain-timeout", "2")  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tinychat")
    make_tiny_chat_model(path)
    return path


def slurm_server(data_dir: Path, model: Path) -> Server:
    return Server(
        data_dir, "--executor", "slurm", "--model", f"tiny={model}",
        "--slurm-tasks", str(NUM_TASKS), "--slurm-sbatch-arg=--gres=none",
        "--slurm-sbatch-arg=--cpus-per-task=1", *(f"--slurm-submit-arg={a}" for a in SUBMIT),
        device=False,
    )  # fmt: skip


def test_batch_as_array_job_survives_requeue_and_restart(model, tmp_path):
    server = slurm_server(tmp_path / "data", model).start()
    client = server.client()
    rows = batch_lines(NUM_ROWS, max_tokens=48, model="tiny")
    upload = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    run = server.data_dir / "runs" / batch.id
    job = _wait("the array job", lambda: _job_id(server.data_dir, batch.id), run, None)
    shards = [run / f"shard-{i}" for i in range(NUM_TASKS)]
    _wait("every task to commit rows", lambda: all(_committed(s) for s in shards), run, job)
    assert _committed(shards[1]) < NUM_ROWS // NUM_TASKS, "task 1 ended before the requeue"
    sh("scontrol", "requeue", f"{job}_1")
    server.kill()
    server.start()
    client = server.client()
    done = wait_batch(
        client, batch.id, lambda b: b.status == "completed", timeout=300, server=server
    )
    assert _job_id(server.data_dir, batch.id) == job  # tracked, never submitted again
    ids = [r["custom_id"] for r in output_lines(client, done.output_file_id)]
    assert len(ids) == len(set(ids)) == NUM_ROWS, diagnostics(run, job)
    assert done.request_counts.completed == NUM_ROWS
    assert "SLURM_RESTART_COUNT=1" in (run / f"slurm-{job}_1.log").read_text()
    assert server.stop() == 0, server.log()


def test_cancel_scancels_and_keeps_the_rows_done(model, tmp_path):
    server = slurm_server(tmp_path / "data", model).start()
    client = server.client()
    rows = batch_lines(NUM_ROWS, max_tokens=48, model="tiny")
    upload = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    run = server.data_dir / "runs" / batch.id
    job = _wait("the array job", lambda: _job_id(server.data_dir, batch.id), run, None)
    shards = [run / f"shard-{i}" for i in range(NUM_TASKS)]
    _wait("every task to commit rows", lambda: all(_committed(s) for s in shards), run, job)
    client.batches.cancel(batch.id)
    end = wait_batch(
        client, batch.id, lambda b: b.status in ("cancelled", "completed"), server=server
    )
    assert end.status == "cancelled", diagnostics(run, job)
    assert not sh("squeue", "-h", "-j", job, check=False).stdout.strip()
    ids = [r["custom_id"] for r in output_lines(client, end.output_file_id)]
    assert len(ids) == len(set(ids)) == end.request_counts.completed > 0
    assert len(ids) < NUM_ROWS and len(ids) == sum(_committed(s) for s in shards)
    assert server.stop() == 0, server.log()
