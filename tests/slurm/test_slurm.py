"""jobs/batchrun-array.sbatch on a real local Slurm (scripts/slurm-local.sh start), CPU only.

(a) a 2-task array job over a JSONL dataset with the tiny chat model completes, and a merge job
    that depends on it (--dependency=afterok) finds every id exactly once;
(b) after both tasks have committed rows, task 1 is requeued (`scontrol requeue JOB_1`, as a
    preemption does) and task 0 gets USR1 (as --signal=B:USR1@120 sends before the time
    limit; the script's trap drains batchrun and requeues the task): both rerun with
    SLURM_RESTART_COUNT=1, resume their shards, and the merged result has every id exactly once.

Each wait is bounded (~120 s) and a failure shows squeue, the job's records and the job logs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from tiny_models import make_tiny_chat_model  # noqa: E402

ARRAY_SCRIPT = ROOT / "jobs" / "batchrun-array.sbatch"
DONE_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}
WAIT_S = 120
# small commits and a narrow batch: a shard of 300 rows runs ~15 s on two cores, long enough to
# be requeued mid-run; the drain must end before Slurm's KILL (KillWait=5 s on the test cluster)
SLOW_RUN = ("--max-tokens", "64", "--ignore-eos", "--max-running", "1", "--commit-every", "5",
            "--drain-timeout", "2")  # fmt: skip


def _cluster_problem() -> str | None:
    if shutil.which("sinfo") is None:
        return "sinfo not found (bash scripts/slurm-local.sh start installs and starts Slurm)"
    try:
        r = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=15
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"sinfo failed: {e}"
    states = {s.rstrip("*~#!%$@^-") for s in r.stdout.split()}
    if r.returncode != 0 or not states & {"idle", "mixed", "allocated"}:
        return f"no Slurm node is up (sinfo: {(r.stdout + r.stderr).strip() or 'nothing'})"
    return None


PROBLEM = _cluster_problem()
REQUIRED = os.environ.get("BATCHRUN_REQUIRE_SLURM") == "1"  # CI: no cluster is a failure
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(PROBLEM is not None and not REQUIRED, reason=str(PROBLEM)),
]


@pytest.fixture(autouse=True)
def _cluster_up():
    if PROBLEM is not None:
        pytest.fail(f"BATCHRUN_REQUIRE_SLURM=1 but {PROBLEM}")


def batchrun_cmd() -> str:
    exe = Path(sys.executable).parent / "batchrun"
    return str(exe) if exe.exists() else f"{sys.executable} -m batchrun.cli"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tinychat")
    make_tiny_chat_model(path)
    return str(path)


def write_dataset(path: Path, num_rows: int) -> list[str]:
    words = ["apple", "river", "stone", "cloud", "lamp", "violin", "garden", "tiger", "salt"]
    ids = [f"q{i:04d}" for i in range(num_rows)]
    with path.open("w") as f:
        for i, rid in enumerate(ids):
            # varied first words: prefix groups land in both shards
            prompt = f"{words[i % 9]} {words[(i * 7) % 9]} number {i}: say something"
            f.write(json.dumps({"id": rid, "prompt": prompt}) + "\n")
    return ids


def sh(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def sbatch(tmp: Path, *args: str) -> str:
    env = {
        **os.environ,
        "BATCHRUN": batchrun_cmd(),
        "OMP_NUM_THREADS": "1",  # two tasks share the machine's cores
        "HF_HUB_OFFLINE": "1",
    }
    r = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={tmp}", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert r.returncode == 0, f"sbatch {' '.join(args)} failed: {r.stderr}"
    return r.stdout.strip().split(";")[0]


def submit_array(tmp: Path, model: str, dataset: Path, out: Path, *extra: str) -> str:
    return sbatch(
        tmp,
        "--array=0-1",
        "--gres=none",  # the script asks for a GPU per task; this cluster has none
        "--cpus-per-task=1",
        "--job-name=batchrun-test",
        f"--output={tmp}/task-%A_%a.log",
        str(ARRAY_SCRIPT),
        str(dataset),
        str(out),
        "--model",
        model,
        "--device",
        "cpu",
        "--temperature",
        "0",
        "--kv-budget",
        "4096",
        *extra,
    )


def job_records(job_id: str) -> list[dict[str, str]]:
    """`scontrol show job -o` as dicts, one per array task (or one for the pending array)."""
    r = sh("scontrol", "show", "job", "-o", job_id, check=False)
    return [
        dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        for line in r.stdout.splitlines()
        if line.strip()
    ]


def diagnostics(tmp: Path, job_id: str) -> str:
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob("*.log")))
    squeue = sh("squeue", check=False).stdout
    records = "\n".join(
        " ".join(
            f"{k}={r.get(k)}"
            for k in ("JobId", "ArrayTaskId", "JobState", "Reason", "ExitCode", "Restarts")
        )
        for r in job_records(job_id)
    )
    return f"squeue:\n{squeue}\njob {job_id}:\n{records}\n{logs}"


def wait_for(what: str, predicate, tmp: Path, job_id: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{diagnostics(tmp, job_id)}")


def finished_states(job_id: str, num_tasks: int) -> dict[str, str] | None:
    """{task id: state} once all `num_tasks` tasks are in a final state, else None."""
    records = job_records(job_id)
    states = {r.get("ArrayTaskId", r.get("JobId", "?")): r.get("JobState", "") for r in records}
    if len(states) == num_tasks and all(s in DONE_STATES for s in states.values()):
        return states
    return None


def assert_completed(tmp: Path, job_id: str, num_tasks: int) -> None:
    states = wait_for(
        f"job {job_id} to finish", lambda: finished_states(job_id, num_tasks), tmp, job_id
    )
    assert set(states.values()) == {"COMPLETED"}, diagnostics(tmp, job_id)


def committed_rows(shard: Path) -> int:
    try:
        manifest = json.loads((shard / "manifest.json").read_text())
    except (OSError, ValueError):
        return 0
    if manifest.get("ledger_rows"):
        return int(manifest["ledger_rows"])
    counts = manifest.get("counts", {})
    return int(counts.get("rows_ok", 0)) + int(counts.get("rows_failed", 0))


def merged_ids(out: Path) -> list[str]:
    """Ids of every row in the merged view (results and errors), one per completion index 0."""
    found = []
    for kind in ("results", "errors"):
        for path in sorted(out.glob(f"merged/{kind}-*.jsonl")) or sorted(
            out.glob(f"{kind}-*.jsonl")
        ):
            for line in path.read_text().splitlines():
                if line.strip():
                    record = json.loads(line)
                    if record.get("index", 0) == 0:
                        found.append(record["id"])
    return found


def merge(out: Path) -> str:
    r = sh(*batchrun_cmd().split(), "merge", str(out), check=False)
    assert r.returncode == 0, f"batchrun merge failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout + r.stderr


def shard_ids(out: Path) -> list[list[str]]:
    return [
        [
            json.loads(line)["id"]
            for p in sorted(d.glob("*s-*.jsonl"))
            for line in p.read_text().splitlines()
            if line.strip()
        ]
        for d in sorted(out.glob("shard-*"))
    ]


def test_array_job_completes_and_merges(model, tmp_path):
    dataset, out = tmp_path / "prompts.jsonl", tmp_path / "run"
    ids = write_dataset(dataset, 24)
    job = submit_array(tmp_path, model, dataset, out, "--max-tokens", "8")
    merge_job = sbatch(
        tmp_path,
        f"--dependency=afterok:{job}",
        "--job-name=batchrun-merge",
        f"--output={tmp_path}/merge-%j.log",
        f"--wrap={batchrun_cmd()} merge {out}",
    )
    assert_completed(tmp_path, job, 2)
    assert_completed(tmp_path, merge_job, 1)

    per_shard = shard_ids(out)
    assert len(per_shard) == 2 and all(per_shard), f"both shards hold rows: {per_shard}"
    logs = sorted(tmp_path.glob("task-*.log"))
    assert len(logs) == 2, [p.name for p in logs]
    for log in logs:
        assert "batchrun exited with 0" in log.read_text(), log.read_text()
    got = merged_ids(out)
    assert sorted(got) == ids, "every id exactly once in the merged view"
    merge(out)  # merging again is fine and still complete


def test_requeued_tasks_resume(model, tmp_path):
    """Task 1: `scontrol requeue` (as preemption does). Task 0: USR1 to the batch shell (as
    --signal=B:USR1@120 does before the time limit): the trap drains batchrun and requeues."""
    dataset, out = tmp_path / "prompts.jsonl", tmp_path / "run"
    ids = write_dataset(dataset, 600)
    job = submit_array(tmp_path, model, dataset, out, *SLOW_RUN)
    shards = [out / "shard-0", out / "shard-1"]
    before = wait_for(
        "both tasks to commit their first rows",
        lambda: all(committed_rows(s) for s in shards) and [committed_rows(s) for s in shards],
        tmp_path,
        job,
    )
    states = {r.get("ArrayTaskId"): r.get("JobState") for r in job_records(job)}
    assert states == {"0": "RUNNING", "1": "RUNNING"}, (
        f"a task is no longer running after committing {before} rows; make the run longer\n"
        + diagnostics(tmp_path, job)
    )
    sh("scontrol", "requeue", f"{job}_1")
    sh("scancel", "--signal=USR1", "--batch", f"{job}_0")
    assert_completed(tmp_path, job, 2)

    logs = [(tmp_path / f"task-{job}_{i}.log").read_text() for i in (0, 1)]
    for i, log in enumerate(logs):
        assert "SLURM_RESTART_COUNT=0" in log and "SLURM_RESTART_COUNT=1" in log, log
        assert "batchrun exited with 5" in log, f"task {i} drained and exited 5\n{log}"
        assert log.rstrip().endswith("batchrun exited with 0"), log
        assert committed_rows(shards[i]) > before[i]
    assert "USR1: time limit near" in logs[0] and "requeueing job" in logs[0], logs[0]
    assert "TERM: draining" in logs[1], logs[1]
    merge(out)
    got = merged_ids(out)
    assert len(got) == len(set(got)) and sorted(got) == ids, (
        f"{len(got)} ids, {len(set(got))} distinct, {len(ids)} expected"
    )
