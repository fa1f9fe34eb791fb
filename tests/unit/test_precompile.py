"""engine/precompile.py's worker pool on the CPU: the workers' protocol, and a variant a worker
cannot compile is a logged warning that leaves it to the capture, never an error. (The pool's
compiles and the dry pass need a GPU: tests/gpu/test_precompile_gpu.py.)"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from batchrun.engine.precompile import CompilePool


def test_a_worker_answers_one_line_for_its_list():
    done = subprocess.run(
        [sys.executable, "-P", "-m", "batchrun.engine.precompile"],
        input="[]", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"compiled": 0, "error": None}


def test_variants_a_worker_cannot_compile_are_left_to_the_capture(caplog):
    pool = CompilePool(2)
    variants = [("batchrun.no_such_module", "_kernel", "{}"), ("json", "dumps", "{}")]
    with caplog.at_level(logging.INFO, logger="batchrun.engine.precompile"):
        pool.compile(variants)
    assert all(proc.poll() is not None for proc in pool.procs)
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1 and "2 of 2 Triton variants did not compile" in warning[0]
    assert "compiled 0 Triton variants in 2 processes" in caplog.text
    pool.close()  # a second close is harmless


def test_a_pool_never_asked_to_compile_closes():
    pool = CompilePool(1)
    pool.close()
    assert pool.procs[0].returncode is not None
