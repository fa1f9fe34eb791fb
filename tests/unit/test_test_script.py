"""`bash scripts/test.sh --help` prints the script's usage and runs nothing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage_and_runs_nothing(flag):
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "test.sh"), "-x", flag],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: bash scripts/test.sh")
    assert "BATCHRUN_SLOW_TESTS" in done.stdout and "passed" not in done.stdout
