"""A quantized mixture of experts on the GPU: Qwen3-30B-A3B-FP8's shapes (two layers, dummy
weights in its block-FP8 format) load with every expert the dequantized FP8 draw, run on the
fused Triton MoE, give the same greedy tokens with CUDA graphs and overlap as eager, and the torch
loop's logits within bf16's precision; the tiny block-FP8 checkpoint's experts load on the GPU
exactly as dequantized on the host.

    pytest tests/gpu/test_moe_quant_gpu.py -q
"""

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
EAGER = dict(moe="triton", cuda_graph_max_bs=0, piecewise_graphs=False)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> str:
    from moe_configs import QWEN3_30B_A3B_FP8

    path = tmp_path_factory.mktemp("qwen3-30b-a3b-fp8")
    (path / "config.json").write_text(json.dumps(dict(QWEN3_30B_A3B_FP8, num_hidden_layers=2)))
    return str(path)


def _requests(num: int = 16):
    from tiny_models import random_prompts

    from batchrun.params import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(num, seed=5, min_len=4, max_len=200)
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


@pytest.fixture(scope="module")
def eager(fp8_dir):
    return _generate(_engine(fp8_dir, EAGER, overlap=False))


def test_experts_are_the_dequantized_draws(fp8_dir):
    from batchrun.models.quant_loader import dummy_source

    engine = _engine(fp8_dir, EAGER)
    assert engine.runner.kernels.moe == "triton"
    model = engine.runner.model
    draw = dummy_source(engine.model_config.quantization, torch.device("cuda"), 0)
    for layer, expert in ((0, 0), (1, 127)):
        w13 = model.layers[layer].mlp.w13[expert]
        up = draw(f"model.layers.{layer}.mlp.experts.{expert}.up_proj", 768, 2048)
        assert torch.equal(w13[768:], up.dequantize(torch.float32).to(w13.dtype))
        w2 = model.layers[layer].mlp.w2[expert]
        down = draw(f"model.layers.{layer}.mlp.experts.{expert}.down_proj", 2048, 768)
        assert torch.equal(w2, down.dequantize(torch.float32).to(w2.dtype))


@pytest.mark.parametrize(
    "kernels,kw",
    [
        (EAGER, dict(overlap=True)),
        (dict(moe="triton", cuda_graph_max_bs=64, piecewise_graphs=False), dict(overlap=True)),
    ],
)
def test_graphs_and_overlap_give_eager_tokens(fp8_dir, eager, kernels, kw):
    assert _generate(_engine(fp8_dir, kernels, **kw)) == eager


def test_fused_moe_logits_match_the_torch_loop(fp8_dir):
    fused = _engine(fp8_dir, EAGER)
    loop = _engine(fp8_dir, dict(EAGER, moe="torch"))
    for req in _requests(4):
        a, b = fused.score(req.input_ids).float(), loop.score(req.input_ids).float()
        assert ((a - b).norm() / b.norm()).item() < 2e-2


def test_tiny_checkpoint_experts_load_exactly(tmp_path):
    from quant_moe_checkpoints import write_quantized_moe

    from batchrun.engine.engine import Engine

    hf = write_quantized_moe("fp8-block", tmp_path)
    kernels = KernelPlan(moe="torch", cuda_graph_max_bs=0, piecewise_graphs=False)
    engine = Engine(EngineConfig(model=str(tmp_path), device="cuda", dtype="float32",
                                 kv_budget=8192), kernels=kernels)  # fmt: skip
    model = engine.runner.model
    for i in engine.model_config.moe.layers:
        want = hf.dequantized[f"model.layers.{i}.mlp.experts.gate_up_proj"].cuda()
        assert torch.equal(model.layers[i].mlp.w13, want)
        want = hf.dequantized[f"model.layers.{i}.mlp.experts.down_proj"].cuda()
        assert torch.equal(model.layers[i].mlp.w2, want)
    outs = _generate(engine)
    assert all(len(tokens) == NEW for tokens in outs.values())
