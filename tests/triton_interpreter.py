"""Run a test module's `__main__` under Triton's CPU interpreter, in a subprocess: TRITON_INTERPRET
must be set before triton is first imported, so it cannot run in the pytest process.

INTERPRETER_KERNELS is the kernel config such a module builds its blocks, pools, backends and
engines with: the Triton kernels on CPU tensors (the interpreter runs them), no PDL (a CUDA launch
attribute), no graphs, no host gate, the decode matmuls on torch (`replace(INTERPRETER_KERNELS,
decode_gemv="triton", decode_norms=...)` for kernels/gemv.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from batchrun.config import KernelPlan

REPO = Path(__file__).resolve().parents[1]

# the Triton attention and small kernels on CPU tensors; everything else plain torch
INTERPRETER_KERNELS = replace(KernelPlan.reference(), attention="triton", triton_ops=True)


def run_under_interpreter(script: str) -> None:
    """Run `script` with TRITON_INTERPRET=1; it must exit 0 and print "ok"."""
    # NOTE: the checkout stays off PYTHONPATH: its kernels/ folder (installed as batchrun.kernels)
    # would shadow the `kernels` distribution that transformers >= 5.25 imports
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, script], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok" in proc.stdout
