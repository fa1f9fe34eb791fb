"""engine/precompile.py on the GPU: with an empty Triton cache, the start-up pool compiles the
decode graphs' variants before the capture, the capture then compiles nothing of its own (the
cache holds no more variants after it than after the pool), and greedy tokens equal an engine
started without the pool (compile_workers 0) on the same cache.

Each start runs in a subprocess of its own with a fresh TRITON_CACHE_DIR (Triton reads it at
import).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

TESTS = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, os, sys
from pathlib import Path
from tiny_models import write_config_dir
from batchrun.config import EngineConfig, KernelPlan
from batchrun.engine import cuda_graph, precompile
from batchrun.engine.engine import Engine
from batchrun.params import GenerateRequest, SamplingParams

cache = Path(os.environ["TRITON_CACHE_DIR"])
counts = {}
def entries():
    return sum(1 for p in cache.rglob("*.json") if not p.name.startswith("__grp__"))
compile = precompile.CompilePool.compile
def counted_compile(self, variants):
    compile(self, variants)
    counts["variants"], counts["after_pool"] = len(variants), entries()
precompile.CompilePool.compile = counted_compile
capture = cuda_graph.CudaGraphRunner._capture
def counted_capture(self, pool):
    capture(self, pool)
    counts["after_capture"] = entries()
cuda_graph.CudaGraphRunner._capture = counted_capture

model = write_config_dir("llama-1b", Path(sys.argv[1]), num_hidden_layers=4)
workers = int(sys.argv[2])
engine = Engine(EngineConfig(model=str(model), load_format="dummy", device="cuda",
                             max_running=32), kernels=KernelPlan(compile_workers=workers))
params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
prompts = [list(range(1000 + i, 1040 + 3 * i)) for i in range(6)]
out = list(engine.generate([GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]))
tokens = {o.rid: list(o.output_ids) for o in out}
print(json.dumps({"counts": counts, "workers": engine.kernels.compile_workers, "tokens": tokens}))
"""


def _start(root: Path, cache: Path, workers: int) -> dict:
    env = dict(os.environ)
    env["TRITON_CACHE_DIR"] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), *sys.path])
    done = subprocess.run(
        [sys.executable, "-P", "-c", SCRIPT, str(root), str(workers)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_pool_compiles_what_the_capture_needs(tmp_path):
    pooled = _start(tmp_path / "model", tmp_path / "cache-pool", 4)
    serial = _start(tmp_path / "model", tmp_path / "cache-serial", 0)
    counts = pooled["counts"]
    assert pooled["workers"] == 4 and counts["variants"] > 0
    assert counts["after_pool"] >= counts["variants"]
    assert counts["after_capture"] == counts["after_pool"], "the capture compiled variants itself"
    assert serial["workers"] == 0 and "variants" not in serial["counts"]
    assert pooled["tokens"] == serial["tokens"]
