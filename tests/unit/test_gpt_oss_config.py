"""gpt-oss configs and weights on the CPU: the released config.json resolve to the right shapes
and parameter counts, the tiny one's counts equal transformers' model's, YaRN's frequencies equal
transformers', MXFP4 dequantizes as transformers' convert_moe_packed_tensors does, and what does
not run is refused naming the field."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gptoss_models import (  # noqa: E402
    GPT_OSS_20B,
    GPT_OSS_120B,
    GPT_OSS_WINDOW,
    gpt_oss_config,
    quantize_mxfp4,
)
from test_kernel_choice import CUDA, gpu, resolve  # noqa: E402, F401

from batchrun.config import EngineConfig, KernelPlan  # noqa: E402
from batchrun.engine.kernel_choice import resolve_kernels  # noqa: E402
from batchrun.errors import ModelConfigError  # noqa: E402
from batchrun.layers.rotary import rope_inv_freq  # noqa: E402
from batchrun.models.config import ModelConfig  # noqa: E402
from batchrun.models.gptoss_weights import mxfp4_dequantize  # noqa: E402
from batchrun.models.param_count import count_params  # noqa: E402

# the model card's figures: total, and active without the embeddings' table
CARDS = {"gpt-oss-20b": (20.91e9, 3.61e9), "gpt-oss-120b": (116.83e9, 5.13e9)}


@pytest.mark.parametrize("name", CARDS)
def test_released_configs_resolve(name):
    raw = GPT_OSS_20B if name == "gpt-oss-20b" else GPT_OSS_120B
    cfg = ModelConfig.from_dict(raw)
    moe = cfg.moe
    experts = 32 if name == "gpt-oss-20b" else 128
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (experts, 4, 2880)
    assert moe.layers == tuple(range(cfg.num_layers))
    assert moe.router_bias and moe.expert_bias and moe.mxfp4
    assert (moe.swiglu_alpha, moe.swiglu_limit) == (1.702, 7.0)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 8, 64)
    assert cfg.qkv_bias and cfg.o_bias and cfg.attention_sinks
    assert cfg.sliding_windows == (128, 0) * (cfg.num_layers // 2)
    assert cfg.quantization is None  # the experts' MXFP4 is the loader's, the rest plain
    rope = cfg.rope_scaling
    assert rope["rope_type"] == "yarn" and cfg.rope_theta == 150000.0
    assert rope["factor"] == 32.0 and rope["original_max_position_embeddings"] == 4096
    assert rope["truncate"] is False
    assert rope["attention_factor"] == pytest.approx(0.1 * torch.log(torch.tensor(32.0)) + 1)
    counts = count_params(cfg)
    total, active = CARDS[name]
    assert counts.total == pytest.approx(total, rel=1e-3)
    embeddings = cfg.vocab_size * cfg.hidden_size
    assert counts.active - embeddings == pytest.approx(active, rel=2e-3)


@pytest.mark.parametrize("raw", [GPT_OSS_20B, None], ids=["20b", "tiny"])
def test_counts_equal_transformers_models(raw):
    import transformers
    from transformers import AutoModelForCausalLM

    if raw is None:
        hf_cfg = gpt_oss_config()
        raw = hf_cfg.to_dict() | {"architectures": ["GptOssForCausalLM"]}
    else:
        plain = {k: v for k, v in raw.items() if k != "quantization_config"}
        hf_cfg = transformers.GptOssConfig(**plain)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg)
    assert count_params(ModelConfig.from_dict(raw)).total == sum(p.numel() for p in hf.parameters())


def test_default_layer_types_slide_on_even_layers():
    raw = {k: v for k, v in GPT_OSS_20B.items() if k != "layer_types"}
    cfg = ModelConfig.from_dict(raw)
    assert cfg.sliding_windows == (128, 0) * 12


@pytest.mark.parametrize(
    "rope",
    [
        {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 4096},
        {"factor": 8.0, "original_max_position_embeddings": 64},  # truncate's default: true
        {"factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5,
         "original_max_position_embeddings": 128},
    ],
)  # fmt: skip
def test_yarn_equals_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = gpt_oss_config(rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, **rope})
    ref, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    cfg = ModelConfig.from_dict(hf_cfg.to_dict() | {"architectures": ["GptOssForCausalLM"]})
    ours = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(ours, ref)
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(ref_factor, rel=1e-12)


def test_mxfp4_dequantizes_as_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 8, 4), generator=g, dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
        ours = mxfp4_dequantize(blocks, scales, dtype)  # [E, out, in]
        assert ours.dtype == dtype
        assert torch.equal(ours, ref.transpose(1, 2))


def test_mxfp4_round_trip_of_the_test_quantizer():
    w = torch.randn(4, 6, 64)
    back = mxfp4_dequantize(*quantize_mxfp4(w))
    # within half of e2m1's coarsest step (2 at a block maximum of 6) of a scale that rounds up
    # to a power of two (at most twice the block's maximum / 6)
    half_step = w.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True) / 6 * 2
    assert ((back - w).unflatten(-1, (-1, 32)).abs() <= half_step).all()


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types must list 24 layers"),
        ({"layer_types": ["chunked_attention"] * 24}, "layer_types must list"),
        ({"sliding_window": 0}, "sliding_window 0"),
        ({"swiglu_limit": "7"}, "swiglu_limit '7' is not a number"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quant_method 'fp8' is not supported"),
        (
            {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": []}},
            "modules_to_not_convert",
        ),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 0.5}}, "yarn factor 0.5"),
    ],
)
def test_refusals_name_the_field(changes, match):
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_dict({**GPT_OSS_20B, **changes})


def test_kernel_choice_refuses_flashinfer_for_sinks():
    cfg = ModelConfig.from_dict(GPT_OSS_20B)
    engine = EngineConfig(model="unused", device="cpu", dtype="float32")
    kernels = resolve_kernels(engine, cfg, torch.device("cpu"))
    assert (kernels.attention, kernels.moe) == ("torch", "torch")
    want = KernelPlan(attention="flashinfer")
    with pytest.raises(ValueError, match="attention backend must be one of auto, torch, triton"):
        resolve_kernels(EngineConfig(model="unused", device="cpu"), cfg, torch.device("cpu"), want)


def test_tiny_window_is_shorter_than_the_prompts():
    cfg = ModelConfig.from_dict(
        gpt_oss_config().to_dict() | {"architectures": ["GptOssForCausalLM"]}
    )
    assert cfg.sliding_windows == (GPT_OSS_WINDOW, 0, GPT_OSS_WINDOW, 0)


def test_mxfp4_experts_that_do_not_fit_dequantized_are_refused(gpu):  # noqa: F811
    """The MXFP4 experts run dequantized to bf16: gpt-oss-20b's decoder (39 GB) fits an H200
    (150 GB) at TP=1; gpt-oss-120b's (231 GB) does not, and the refusal names the --tp that
    fits (2: 115.7 GB a rank, under 85 %), before any weight is read. A bf16 checkpoint is not
    dequantized: no refusal."""
    gpu(pdl=True)
    resolve(ModelConfig.from_dict(GPT_OSS_20B), CUDA)
    big = ModelConfig.from_dict(GPT_OSS_120B)
    assert big.moe.mxfp4
    with pytest.raises(ValueError, match=r"quantization_config mxfp4 \(gpt-oss's experts\): a "
                       r"quantized mixture of experts .* at --tp 1, .*; --tp 2 \(115.7 GB a rank\) "
                       r"fits"):  # fmt: skip
        resolve(big, CUDA)
    resolve(big, CUDA, tp_size=2)
    plain = {k: v for k, v in GPT_OSS_120B.items() if k != "quantization_config"}
    resolve(ModelConfig.from_dict(plain), CUDA)
