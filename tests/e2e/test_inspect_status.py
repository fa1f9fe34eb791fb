"""`batchrun inspect` tells a live run (its lock held by the process running it) from an
interrupted one (killed with SIGKILL, or stopped before its final commit), and names the
command that resumes it; a second `submit` into a live run's directory is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from tiny_models import make_tiny_chat_model  # noqa: E402

from batchrun.cli import main  # noqa: E402
from batchrun.job.run_lock import command_line  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tinychat")
    make_tiny_chat_model(path)
    return str(path)


def argv(model: str, dataset: Path, out: Path) -> list[str]:
    return ["submit", str(dataset), "--out", str(out), "--model", model, "--device", "cpu",
            "--max-tokens", "400", "--ignore-eos", "--max-running", "2", "--commit-every", "1",
            "--kv-budget", "4096", "--quiet"]  # fmt: skip


def wait_running(proc: subprocess.Popen, out: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            m = json.loads((out / "manifest.json").read_text())
        except (OSError, ValueError):
            m = None
        if m is not None and m["ledger_rows"] >= 1:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    raise AssertionError("the run committed no row")


def test_live_then_killed_run(model, tmp_path):
    dataset = tmp_path / "in.jsonl"
    dataset.write_text("".join(f'{{"prompt": "row {i}"}}\n' for i in range(40)))
    out = tmp_path / "o"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchrun.cli", *argv(model, dataset, out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_running(proc, out)
        live = CliRunner().invoke(main, ["inspect", str(out)])
        assert f"status       running (process {proc.pid} on" in live.output, live.output
        assert "resume" not in live.output
        second = CliRunner().invoke(main, argv(model, dataset, out))
        assert second.exit_code == 1 and "is in use" in second.output, second.output
        assert str(proc.pid) in second.output
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    assert json.loads((out / "manifest.json").read_text())["status"] == "running"
    dead = CliRunner().invoke(main, ["inspect", str(out)])
    assert dead.exit_code == 0, dead.output
    assert "status       interrupted (" in dead.output
    resume = next(line for line in dead.output.splitlines() if line.startswith("resume"))
    assert f"cd {os.getcwd()} && python -m batchrun submit {dataset} --out {out}" in resume


def test_command_line():
    assert (
        command_line(["/venv/bin/batchrun", "submit", "a b.jsonl"]) == "batchrun submit 'a b.jsonl'"
    )
    assert command_line(["/x/batchrun/cli/__main__.py", "plan", "d"]) == "python -m batchrun plan d"
    assert command_line(["job.py", "--out", "o"]) == "python job.py --out o"
