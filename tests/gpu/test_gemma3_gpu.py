"""Gemma 3 on the GPU with the default kernels (Triton attention with its sliding window, CUDA
graphs for decode and piecewise graphs for prefill, overlap on): the tiny model's greedy tokens
equal transformers' in fp32 past the window; gemma-3-1b's shapes (two layers: one sliding, one
full, with the 4b's linear rope scaling) give the same greedy tokens with graphs and overlap as
eager, in bf16 with dummy weights."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from batchrun.config import EngineConfig, KernelPlan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NEW = 64


def _requests(num: int, max_len: int):
    from tiny_models import random_prompts

    from batchrun.params import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(num, seed=5, min_len=12, max_len=max_len)
    shared = prompts[0][:40]
    prompts = [shared + p if i % 2 else p for i, p in enumerate(prompts)]
    return [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]


def _generate(engine, reqs) -> dict[str, list[int]]:
    out = {r.rid: r.output_ids for r in engine.generate(reqs)}
    engine.check_integrity()
    return out


def test_tiny_gemma3_equals_transformers_with_graphs_and_overlap(tmp_path):
    from tiny_models import make_tiny_model

    from batchrun.engine.engine import Engine

    hf = make_tiny_model("gemma3", tmp_path).cuda()
    engine = Engine(EngineConfig(model=str(tmp_path), device="cuda", dtype="float32",
                                 kv_budget=8192))  # fmt: skip
    assert engine.kernels.attention != "torch" and engine.kernels.cuda_graph_max_bs > 0
    reqs = _requests(8, 60)
    got = _generate(engine, reqs)
    for req in reqs:
        ids = torch.tensor([req.input_ids], device="cuda")
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                           min_new_tokens=NEW, do_sample=False, pad_token_id=0)  # fmt: skip
        assert got[req.rid] == want[0, len(req.input_ids) :].tolist(), req.rid


def test_gemma3_1b_shapes_graphs_and_overlap_equal_eager(tmp_path):
    from gemma3_configs import GEMMA3_1B_IT

    from batchrun.engine.engine import Engine

    raw = dict(GEMMA3_1B_IT, num_hidden_layers=2, sliding_window_pattern=2,
               rope_scaling={"rope_type": "linear", "factor": 8.0})  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    base = dict(model=str(tmp_path), load_format="dummy", device="cuda", dtype="bfloat16",
                kv_budget=20000, chunked_prefill_size=256)  # fmt: skip
    reqs = _requests(24, 900)  # past the 512-token window
    graphs = _generate(Engine(EngineConfig(**base)), reqs)
    eager_kernels = KernelPlan(cuda_graph_max_bs=0, piecewise_graphs=False)
    eager = Engine(EngineConfig(**base, overlap=False), kernels=eager_kernels)
    assert _generate(eager, reqs) == graphs
