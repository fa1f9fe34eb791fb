"""The GPU runtime gives the same greedy tokens whichever way it runs: CUDA graphs or eager,
overlap on or off, Triton or torch attention, and equals HF transformers in fp32."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_models import make_tiny_model

    path = tmp_path_factory.mktemp("llama-gpu")
    make_tiny_model("llama", path)
    return str(path)


def _requests(num: int, new: int):
    from tiny_models import random_prompts

    from batchrun.engine.params import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(num, seed=11, min_len=4, max_len=120)
    # a shared prefix for half of them, so the radix cache and extend-over-prefix run too
    shared = prompts[0][:30]
    prompts = [shared + p if i % 2 else p for i, p in enumerate(prompts)]
    return [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]


def _run(model_dir: str, **kw) -> dict[str, list[int]]:
    from batchrun.engine.config import EngineConfig
    from batchrun.engine.engine import Engine

    cfg = dict(model=model_dir, device="cuda", dtype="float32", kv_budget=20000)
    engine = Engine(EngineConfig(**{**cfg, **kw}))
    out = {r.rid: r.output_ids for r in engine.generate(_requests(40, 48))}
    engine.check_integrity()
    return out


@pytest.fixture(scope="module")
def reference(model_dir):
    return _run(model_dir, attention_backend="torch", overlap=False, cuda_graph_max_bs=0)


@pytest.mark.parametrize(
    "kw",
    [
        dict(attention_backend="triton", overlap=False, cuda_graph_max_bs=0),
        dict(attention_backend="triton", overlap=True, cuda_graph_max_bs=0),
        dict(attention_backend="triton", overlap=False, cuda_graph_max_bs=64),
        dict(attention_backend="triton", overlap=True, cuda_graph_max_bs=64),
        dict(
            attention_backend="triton",
            overlap=True,
            cuda_graph_max_bs=64,
            kv_budget=1200,
            new_token_ratio=0.05,
        ),
        dict(attention_backend="torch", overlap=True, cuda_graph_max_bs=0),
    ],
    ids=[
        "triton-eager",
        "triton-overlap",
        "triton-graph",
        "triton-graph-overlap",
        "triton-graph-overlap-retract",
        "torch-overlap",
    ],
)
def test_same_greedy_tokens(model_dir, reference, kw):
    assert _run(model_dir, **kw) == reference


def test_matches_hf_on_cuda(model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    ours = _run(model_dir, attention_backend="triton", overlap=True, cuda_graph_max_bs=64)
    for req in _requests(6, 48):
        ids = torch.tensor([req.input_ids], device="cuda")
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=48,
            min_new_tokens=48,
            do_sample=False,
            pad_token_id=0,
        )
        assert ours[req.rid] == out[0, ids.shape[1] :].tolist(), req.rid
