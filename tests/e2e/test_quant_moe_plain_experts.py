"""A compressed-tensors Qwen3-MoE as transformers 5 saves it: its experts are one fused module
there, not nn.Linear, so they are saved unquantized (per expert, a plain `weight`, no
`weight_scale`) under a config whose "Linear" target covers them, while the attention and the
dense MLP are FP8. batchrun loads what the checkpoint holds, as transformers does: the experts
plain, the rest FP8, the logits those of the fp32 model with these weights. A linear that a
target names (a "re:" pattern) stays quantized: there a missing scale is an error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quant_moe_checkpoints import write_quantized_moe  # noqa: E402
from test_quant_fp8 import EXACT, engine_for, rel  # noqa: E402
from tiny_models import random_prompts  # noqa: E402

from batchrun.errors import WeightLoadError  # noqa: E402
from batchrun.models.config import ModelConfig  # noqa: E402
from batchrun.models.moe_weights import has_quantized_experts  # noqa: E402


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("ct-fp8-plain-experts")
    return path, write_quantized_moe("ct-fp8-channel", path, plain_experts=True)


def test_plain_experts_under_a_linear_target_load_as_transformers_does(written):
    path, hf = written
    qcfg = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qcfg["config_groups"]["group_0"]["targets"] == ["Linear"]
    cfg = ModelConfig.from_dir(path)
    assert cfg.quantization.is_quantized("model.layers.0.self_attn.q_proj")
    assert not cfg.quantization.is_quantized("model.layers.0.mlp.experts.3.gate_proj")
    assert not has_quantized_experts(cfg)
    engine = engine_for(path)
    model = engine.runner.model
    for i in engine.model_config.moe.layers:
        mlp = model.layers[i].mlp
        assert torch.equal(mlp.w13, hf.dequantized[f"model.layers.{i}.mlp.experts.gate_up_proj"])
        assert model.layers[i].self_attn.qkv_proj.quant is not None
    for prompt in random_prompts(3, seed=1, min_len=8, max_len=60):
        ours = engine.score(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert rel(ours, ref) <= EXACT, f"relative error {rel(ours, ref):.2e}"
    engine.check_integrity()


def test_experts_a_target_names_stay_quantized(written, tmp_path):
    path, _ = written
    named = tmp_path / "named"
    named.mkdir()
    for f in path.iterdir():
        (named / f.name).symlink_to(f)
    (named / "config.json").unlink()
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"]["config_groups"]["group_0"]["targets"] = [
        "re:.*self_attn.*",
        "re:.*mlp.*_proj$",
    ]
    (named / "config.json").write_text(json.dumps(raw))
    cfg = ModelConfig.from_dir(named)
    assert cfg.quantization.is_quantized("model.layers.0.mlp.experts.3.gate_proj")
    with pytest.raises(WeightLoadError, match=r"experts\.\d+\.\w+_proj\.weight_scale"):
        engine_for(named)
