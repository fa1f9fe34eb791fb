"""Gemma 4's window pool on the Triton attention kernels, under Triton's CPU interpreter (a
subprocess: tests/triton_interpreter.py), fp32: the tiny dense and E-models (the sliding layers
keep only their window, freed every step) give the torch kernels' greedy tokens past the window,
unchunked and in chunks across it, with the radix cache off and on (engine/window_tree.py);
tests/e2e/test_gemma4_window.py checks the torch kernels against transformers."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # CI's slow tier (BATCHRUN_SLOW_TESTS=1)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from triton_interpreter import INTERPRETER_KERNELS  # noqa: E402


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_gemma4_window_pool_under_interpreter():
    from triton_interpreter import run_under_interpreter

    run_under_interpreter(__file__)


def _check_engine(tmp_dir: Path) -> None:
    from gemma4_models import WINDOW, make_gemma4
    from tiny_models import random_prompts

    from batchrun.config import EngineConfig, KernelPlan
    from batchrun.engine import window_pool
    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    window_pool.FREE_STRIDE = 1  # a process of its own: free behind the window every step
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(3, seed=4, min_len=WINDOW + 2, max_len=WINDOW + 20)
    for kind in ("dense", "e-model"):
        path = Path(tempfile.mkdtemp(dir=tmp_dir))
        make_gemma4(kind, path)
        base = dict(model=str(path), device="cpu", dtype="float32", kv_budget=512)
        runs = [
            (KernelPlan.reference(), {}),
            (INTERPRETER_KERNELS, dict(enable_radix_cache=False, chunked_prefill_size=None)),
            (INTERPRETER_KERNELS, dict(chunked_prefill_size=WINDOW + 1)),
        ]
        outs = []
        for kernels, kw in runs:
            engine = Engine(EngineConfig(**base, **kw), kernels=kernels)
            assert engine.runner.window is not None
            reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
            outs.append({r.rid: r.output_ids for r in engine.generate(reqs)})
            engine.check_integrity()
        assert engine.kernels.attention == "triton"
        assert outs[0] == outs[1] == outs[2], kind


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        _check_engine(Path(tmp))
    print("ok")
