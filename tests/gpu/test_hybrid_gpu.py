"""Hybrid linear-attention models on the GPU with the default kernels (Triton attention on the
full-attention layers, overlap on; the linear layers on fla-core's kernels and
kernels/causal_conv1d.py, decode CUDA graphs with the states in their inputs): the tiny
Qwen3-Next and Qwen3.5 models' greedy tokens equal transformers' in fp32 for a batch of mixed
lengths, chunked prefill included; in bf16 every row runs to its length."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from batchrun.config import EngineConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# NOTE: fp32 dots of the Triton kernels in full fp32, not TF32: the fp32 engine is compared token
# for token with transformers (as in test_hybrid_kernels_gpu.py)
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

NEW = 32
LENGTHS = (2, 3, 9, 26, 64, 65, 130, 300)


def _requests():
    from batchrun.params import GenerateRequest, SamplingParams

    g = torch.Generator().manual_seed(3)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    return [
        GenerateRequest(str(i), torch.randint(3, 256, (n,), generator=g).tolist(), params)
        for i, n in enumerate(LENGTHS)
    ]


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_text"])
def test_tiny_hybrid_equals_transformers(kind, tmp_path):
    from hybrid_models import make_hybrid_model

    from batchrun.engine.engine import Engine

    hf = make_hybrid_model(kind, tmp_path).cuda()
    engine = Engine(EngineConfig(model=str(tmp_path), device="cuda", dtype="float32",
                                 kv_budget=8192, chunked_prefill_size=100))  # fmt: skip
    assert engine.runner.states is not None and engine.runner.graphs is not None
    assert engine.kernels.linear_attention == "fla"
    reqs = _requests()
    got = {r.rid: r.output_ids for r in engine.generate(reqs)}
    engine.check_integrity()
    for req in reqs:
        ids = torch.tensor([req.input_ids], device="cuda")
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                           min_new_tokens=NEW, do_sample=False, pad_token_id=0)  # fmt: skip
        assert got[req.rid] == want[0, ids.shape[1] :].tolist(), f"request {req.rid}"


def test_tiny_hybrid_runs_in_bf16(tmp_path):
    from hybrid_models import make_hybrid_model

    from batchrun.engine.engine import Engine

    make_hybrid_model("qwen3_5_moe", tmp_path)
    engine = Engine(EngineConfig(model=str(tmp_path), device="cuda", dtype="bfloat16"))
    results = list(engine.generate(_requests()))
    engine.check_integrity()
    assert len(results) == len(LENGTHS) and all(len(r.output_ids) == NEW for r in results)
