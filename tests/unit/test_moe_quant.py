"""A quantized mixture of experts' config and weights: Qwen3-30B-A3B-FP8's real config.json
resolves (its experts quantized, its routers and lm_head plain) with the bf16 model's counts;
each expert is dequantized at load into w13 / w2, a TP rank holding its slice of the TP=1
tensor (checkpoint and dummy weights); a scale of the wrong shape, or a missing one, is named;
on CUDA the model is refused where its dequantized weights do not fit; `--quantization fp8`
quantizes the attention and leaves the experts plain."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_configs import QWEN3_30B_A3B, QWEN3_30B_A3B_FP8  # noqa: E402
from quant_moe_checkpoints import write_quantized_moe  # noqa: E402
from test_kernel_choice import CUDA, gpu, resolve  # noqa: E402, F401
from test_tp_partition import assert_rank_holds_its_slices  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from batchrun.errors import WeightLoadError  # noqa: E402
from batchrun.models.config import ModelConfig  # noqa: E402
from batchrun.models.loader import load_model  # noqa: E402
from batchrun.models.moe_weights import has_quantized_experts  # noqa: E402
from batchrun.models.param_count import count_params, describe_params  # noqa: E402
from batchrun.models.quant_loader import dummy_source  # noqa: E402
from batchrun.parallel.state import TPGroup  # noqa: E402
from batchrun.quant.online import with_quantization  # noqa: E402

GB = 1e9


def load(path, cfg: ModelConfig, load_format: str = "safetensors", tp: TPGroup | None = None):
    return load_model(path, cfg, load_format, torch.float32, "cpu", 64, seed=3, tp=tp)


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8-moe")
    hf = write_quantized_moe("fp8-block", path, shards=1)
    return path, hf


def test_qwen3_30b_a3b_fp8_resolves():
    cfg = ModelConfig.from_dict(QWEN3_30B_A3B_FP8)
    scheme = cfg.quantization
    assert (scheme.method, scheme.block, scheme.activations) == ("fp8", (128, 128), "dynamic")
    assert scheme.is_quantized("model.layers.47.mlp.experts.127.down_proj")
    assert scheme.is_quantized("model.layers.0.self_attn.q_proj")
    assert not scheme.is_quantized("model.layers.3.mlp.gate")
    assert not scheme.is_quantized("lm_head")
    assert has_quantized_experts(cfg)
    plain = ModelConfig.from_dict(QWEN3_30B_A3B)
    assert not has_quantized_experts(plain)
    assert count_params(cfg) == count_params(plain)
    assert count_params(cfg)[:2] == (30_532_122_624, 3_353_032_704)
    assert describe_params(cfg) == (
        "30.53 B parameters, 3.35 B active a token (8 of 128 experts a token in 48 of 48 layers)"
    )


def test_experts_are_the_dequantized_weights_and_ranks_hold_their_slices(fp8_moe):
    """Width 192 at TP=2: 96 rows a rank, half a 128-block, cut from the dequantized tensor."""
    path, hf = fp8_moe
    cfg = ModelConfig.from_dir(path)
    full = load(path, cfg)
    for i in cfg.moe.layers:
        mlp = full.layers[i].mlp
        assert torch.equal(mlp.w13, hf.dequantized[f"model.layers.{i}.mlp.experts.gate_up_proj"])
        assert torch.equal(mlp.w2, hf.dequantized[f"model.layers.{i}.mlp.experts.down_proj"])
        assert torch.equal(mlp.gate.weight, hf.model.layers[i].mlp.gate.weight)
        assert full.layers[i].self_attn.qkv_proj.quant is not None
    assert full.layers[1].mlp.gate_up_proj.quant is not None  # the dense layer's MLP
    ranks = [load(path, cfg, tp=TPGroup(r, 2)) for r in range(2)]
    assert ranks[0].layers[0].mlp.w13.shape == (8, 192, 256)
    assert_rank_holds_its_slices(full, ranks)


def test_dummy_experts_are_the_schemes_random_weights_dequantized(fp8_moe):
    path, _ = fp8_moe
    cfg = ModelConfig.from_dir(path)
    full = load(None, cfg, "dummy")
    draw = dummy_source(cfg.quantization, torch.device("cpu"), 3)
    w13 = full.layers[2].mlp.w13[5]
    assert torch.equal(
        w13[192:], draw("model.layers.2.mlp.experts.5.up_proj", 192, 256).dequantize()
    )
    w2 = full.layers[0].mlp.w2[7]
    assert torch.equal(w2, draw("model.layers.0.mlp.experts.7.down_proj", 256, 192).dequantize())
    ranks = [load(None, cfg, "dummy", TPGroup(r, 2)) for r in range(2)]
    assert_rank_holds_its_slices(full, ranks)


def _rewrite(src: Path, dst: Path, change) -> None:
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())


@pytest.mark.parametrize("damage", ["shape", "missing"])
def test_a_bad_expert_scale_is_named(fp8_moe, tmp_path, damage):
    path, _ = fp8_moe
    name = "model.layers.2.mlp.experts.3.up_proj.weight_scale_inv"

    def change(tensors):
        if damage == "shape":
            tensors[name] = torch.ones(1, 2)
        else:
            del tensors[name]

    _rewrite(path, tmp_path / "bad", change)
    match = {
        "shape": f"{name} has shape \\(1, 2\\) float32; .* expects shape \\(2, 2\\)",
        "missing": f"the checkpoint lacks {name}",
    }[damage]
    with pytest.raises(WeightLoadError, match=match):
        load(tmp_path / "bad", ModelConfig.from_dir(tmp_path / "bad"))


def test_refused_on_cuda_where_the_dequantized_weights_do_not_fit(gpu, monkeypatch):  # noqa: F811
    """Qwen3-30B-A3B's decoder takes 59.8 GB in bf16: it fits 85 % of an 80 GB GPU at TP=1,
    not of a 48 GB one, where TP=2 (29.9 GB a rank) does. Its attention's block-FP8 linears
    stay in FP8 where cuBLASLt's block matmul runs, else are dequantized where they fit."""
    from batchrun.engine import kernel_choice

    fp8 = ModelConfig.from_dict(QWEN3_30B_A3B_FP8)
    gpu(pdl=True)
    assert resolve(fp8, CUDA).fp8_matmul == "scaled_mm"
    monkeypatch.setattr(kernel_choice, "supports_block_scaled_mm", lambda device: False)
    assert resolve(fp8, CUDA).fp8_matmul == "dequant"
    gpu(pdl=True, memory=80_000_000_000)  # the experts dequantized, the rest on FP8 kernels
    assert resolve(fp8, CUDA).fp8_matmul == "scaled_mm"
    gpu(pdl=True, memory=48_000_000_000)
    with pytest.raises(
        ValueError,
        match="a quantized mixture of experts runs its experts dequantized to bf16, and the "
        "decoder's bf16 weights take 59.8 GB a rank at --tp 1, more than 85% of this GPU's "
        "48.0 GB \\(40.8 GB\\); --tp 2 \\(29.9 GB a rank\\) fits",
    ):
        resolve(fp8, CUDA)
    assert resolve(fp8, CUDA, tp_size=2).fp8_matmul == "scaled_mm"
    # experts left plain (a bf16 checkpoint, or --quantization fp8's attention-only FP8) are
    # not dequantized: no refusal
    plain = ModelConfig.from_dict(QWEN3_30B_A3B)
    resolve(plain, CUDA)
    resolve(with_quantization(plain, "fp8", "/models/qwen3-30b-a3b"), CUDA)
    no_experts = replace(fp8.quantization, ignore=replace(fp8.quantization.ignore, patterns=(
        "lm_head", "mlp.experts")))  # fmt: skip
    resolve(replace(fp8, quantization=no_experts), CUDA)


def test_online_fp8_quantizes_the_attention_and_leaves_the_experts(tmp_path):
    hf = make_tiny_model("qwen3_moe", tmp_path)
    cfg = with_quantization(ModelConfig.from_dir(tmp_path), "fp8", str(tmp_path))
    assert not has_quantized_experts(cfg)
    model = load(tmp_path, cfg)
    for i in cfg.moe.layers:
        assert model.layers[i].self_attn.qkv_proj.quant is not None
        assert torch.equal(model.layers[i].mlp.w13, hf.model.layers[i].mlp.experts.gate_up_proj)
        assert torch.equal(model.layers[i].mlp.w2, hf.model.layers[i].mlp.experts.down_proj)
