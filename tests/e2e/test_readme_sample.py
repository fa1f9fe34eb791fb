"""README.md's sample output is what its example command produces (scripts/readme_sample.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # CI's slow tier (BATCHRUN_SLOW_TESTS=1)

ROOT = Path(__file__).resolve().parents[2]


def test_readme_sample_output_is_the_example_run():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "readme_sample.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
