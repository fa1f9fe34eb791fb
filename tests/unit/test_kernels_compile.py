"""scripts/check_kernels_compile.py compiles the quantization kernels for sm_90 on this machine
(no GPU): a kernel the installed Triton cannot compile for the H200's architecture fails here.
The GPU machine's Triton (3.6) is stricter than newer ones: run the script with it before a GPU
run (its docstring says how). Skipped where triton is not installed (CI does not install it)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # CI's slow tier (BATCHRUN_SLOW_TESTS=1)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_kernels_compile.py"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_the_quantization_kernels_compile_for_sm_90():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", "90"], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "0 failed" in proc.stdout
