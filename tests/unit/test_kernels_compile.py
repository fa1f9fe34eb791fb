"""scripts/check_kernels_compile.py compiles the quantization kernels for sm_90 on this machine
(no GPU): a kernel the installed Triton cannot compile for the H200's architecture fails here.
The GPU machine's Triton (3.6) is stricter than newer ones: run the script with it before a GPU
run (its docstring says how). Skipped where triton is not installed (CI does not install it)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # CI's slow tier (BATCHRUN_SLOW_TESTS=1)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_kernels_compile.py"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_the_quantization_kernels_compile_for_sm_90():
    """Every case compiles; and the loops that moved tiles through shared memory more often than
    they need to do not again (--sass, the kernels' docstrings): the decode kernel reads a
    float8 pool's V without one-byte shared loads, and with its own rotary runs the plain loop
    (its new token patched outside it)."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", "90", "--sass"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "0 failed" in proc.stdout
    loops = _loops(proc.stdout)
    for splits in (1, 16):
        assert loops[f"decode_attention fp8 splits={splits} window=0"]["byte_loads"] == 0
    plain = loops["decode_attention splits=1 window=0"]["instructions"]
    assert loops["decode_attention splits=16 window=0"]["instructions"] <= 1.2 * plain


def _loops(stdout: str) -> dict[str, dict[str, int]]:
    """Case name -> its (last) kernel's loop figures, from the --sass lines above its OK line."""
    pattern = re.compile(
        r"loop (\d+) instructions: (\d+) barriers, \d+ shared stores, \d+ shared loads "
        r"\((\d+) of one byte\)"
    )
    loops, last = {}, None
    for line in stdout.splitlines():
        if m := pattern.search(line):
            last = dict(zip(("instructions", "barriers", "byte_loads"), map(int, m.groups())))
        elif line.startswith("OK    ") and last is not None:
            loops[line[6:].strip()], last = last, None
    return loops
