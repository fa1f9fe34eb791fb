"""Phi-3 / Phi-4 (partial rotary, LongRoPE, fused qkv / gate_up checkpoints) on the GPU: on
Phi-4-mini's widths (two layers, dummy bf16 weights; 96 of 128 dims rotating) greedy tokens are
the same with CUDA graphs (decode and piecewise) or eager, overlap on or off, the one-row decode
on kernels/gemv.py or not, with the short factors (a context of 4096) and the long ones; the
Triton attention's logits are the torch backend's within bf16's precision; and the
tiny Phi-3 equals transformers in fp32 on the torch attention, and its CUDA-graph run on the
Triton attention gives the eager torch engine's tokens."""

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

NEW = 32
EAGER = dict(attention="triton", cuda_graph_max_bs=0, piecewise_graphs=False, decode_gemv="cublas")


@pytest.fixture(scope="module")
def phi4_dir(tmp_path_factory) -> str:
    from phi3_configs import PHI4_MINI_INSTRUCT

    path = tmp_path_factory.mktemp("phi4-mini")
    (path / "config.json").write_text(json.dumps(dict(PHI4_MINI_INSTRUCT, num_hidden_layers=2)))
    return str(path)


def _requests(num: int = 24):
    from tiny_models import random_prompts

    from batchrun.params import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(num, seed=5, min_len=4, max_len=200)
    shared = prompts[0][:40]
    prompts = [shared + p if i % 2 else p for i, p in enumerate(prompts)]
    return [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]


def _engine(model_dir: str, kernels: dict, **kw):
    from batchrun.engine.engine import Engine

    cfg = dict(model=model_dir, load_format="dummy", device="cuda", dtype="bfloat16",
               kv_budget=20000, chunked_prefill_size=256)  # fmt: skip
    return Engine(EngineConfig(**{**cfg, **kw}), kernels=KernelPlan(**kernels))


def _generate(engine) -> dict[str, list[int]]:
    out = {r.rid: r.output_ids for r in engine.generate(_requests())}
    engine.check_integrity()
    return out


@pytest.fixture(scope="module", params=[4096, None], ids=["short-factors", "long-factors"])
def context_len(request):
    return request.param


@pytest.fixture(scope="module")
def eager(phi4_dir, context_len):
    return _generate(_engine(phi4_dir, EAGER, overlap=False, context_len=context_len))


@pytest.mark.parametrize(
    "kernels,kw",
    [
        (dict(EAGER), dict(overlap=True)),
        (dict(EAGER, cuda_graph_max_bs=64), dict(overlap=False)),
        (dict(EAGER, cuda_graph_max_bs=64, piecewise_graphs=True), dict(overlap=True)),
        (dict(EAGER, cuda_graph_max_bs=64, decode_gemv="triton"), dict(overlap=True)),
        # one-row decode steps: models/fused_decode.py, the norms inside the matmuls
        (dict(EAGER, cuda_graph_max_bs=64, decode_gemv="triton"), dict(max_running=1)),
    ],
)
def test_graphs_and_overlap_give_eager_tokens(phi4_dir, context_len, eager, kernels, kw):
    engine = _engine(phi4_dir, kernels, context_len=context_len, **kw)
    rotary = engine.runner.model.rotary
    assert rotary.cos_cache.shape[1] == 96
    reference = eager
    if kernels.get("decode_gemv") == "triton" or "max_running" in kw:
        # the eager run of the same matmuls over the same batches: the GEMV's sums are not
        # cuBLAS's, and one request at a time prefills alone (bf16 near-ties part otherwise)
        same = dict(EAGER, decode_gemv=kernels.get("decode_gemv", "cublas"))
        batches = {k: v for k, v in kw.items() if k != "overlap"}
        reference = _generate(
            _engine(phi4_dir, same, overlap=False, context_len=context_len, **batches)
        )
    assert _generate(engine) == reference


@pytest.mark.parametrize("attention", ["triton"])
def test_attention_backends_match_the_torch_backend(phi4_dir, attention):
    kernels = dict(cuda_graph_max_bs=0, piecewise_graphs=False)
    fused = _engine(phi4_dir, dict(kernels, attention=attention))
    ref = _engine(phi4_dir, dict(kernels, attention="torch", triton_ops=False))
    for req in _requests(4):
        a, b = fused.score(req.input_ids).float(), ref.score(req.input_ids).float()
        assert ((a - b).norm() / b.norm()).item() < 2e-2


def test_tiny_phi3_equals_transformers_and_its_graph_run_the_eager_one(tmp_path):
    from tiny_models import make_tiny_model, random_prompts

    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    hf = make_tiny_model("phi3", tmp_path).cuda()
    base = dict(model=str(tmp_path), device="cuda", dtype="float32", kv_budget=8192,
                context_len=128)  # fmt: skip
    torch_kernels = KernelPlan(attention="torch", cuda_graph_max_bs=0, piecewise_graphs=False)
    ref = Engine(EngineConfig(**base, overlap=False), kernels=torch_kernels)
    for prompt in random_prompts(3, seed=1, min_len=8, max_len=60):
        ours = ref.score(prompt).float()
        with torch.no_grad():
            want = hf(torch.tensor([prompt], device="cuda")).logits[0].float()
        assert ((ours - want).norm() / want.norm()).item() <= 1e-4
    graphs = Engine(EngineConfig(**base), kernels=KernelPlan(attention="triton"))
    assert graphs.runner.kernels.cuda_graph_max_bs > 0
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(random_prompts(8, seed=2))]
    want = {r.rid: r.output_ids for r in ref.generate(reqs)}
    assert {r.rid: r.output_ids for r in graphs.generate(reqs)} == want
    graphs.check_integrity()
