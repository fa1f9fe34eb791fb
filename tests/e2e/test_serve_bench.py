"""scripts/bench_serve.py on the CPU: its --help, and a tiny run on the embedded model (the GPU
run is the lead's: see the script's docstring)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_serve.py"


def test_help():
    r = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--rows" in r.stdout and "--embedded" in r.stdout, r.stderr


@pytest.mark.slow
def test_tiny_run_on_the_embedded_model(tmp_path):
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--embedded", "--device", "cpu", "--rows", "4",
         "--max-tokens", "4", "--poll-s", "0.2", "--probe-hz", "5"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
        env={**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "| batchrun serve |" in r.stdout and "texts equal: yes" in r.stdout
    result = json.loads((tmp_path / "bench_serve.json").read_text())
    assert result["rows"] == 4 and result["texts_equal"] and result["serve_s"] > 0
