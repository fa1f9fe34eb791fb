"""Mixture-of-experts configs: the real models' config.json resolve to the right shapes and
parameter counts (total and active, as their model cards give them), the tiny ones' counts equal
transformers' models', what does not run is refused by name, and tensor parallel names the width
that does not divide."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_configs import (  # noqa: E402
    MIXTRAL_8X7B_INSTRUCT,
    QWEN3_30B_A3B,
    QWEN3_235B_A22B,
    QWEN15_MOE_A27B,
)
from tiny_models import MOE_KINDS, make_moe_config  # noqa: E402

from batchrun.config import EngineConfig, KernelPlan, is_large  # noqa: E402
from batchrun.engine.kernel_choice import resolve_kernels  # noqa: E402
from batchrun.errors import ModelConfigError  # noqa: E402
from batchrun.models.config import ModelConfig  # noqa: E402
from batchrun.models.param_count import count_params  # noqa: E402
from batchrun.parallel.partition import partition_model  # noqa: E402

# name -> (config.json, experts, top-k, expert width, shared width, renormalized, total, active)
REAL = {
    "Qwen3-30B-A3B": (QWEN3_30B_A3B, 128, 8, 768, 0, True, 30_532_122_624, 3_353_032_704),
    "Qwen3-235B-A22B": (QWEN3_235B_A22B, 128, 8, 1536, 0, True, 235_093_634_560, 22_190_763_520),
    "Qwen1.5-MoE-A2.7B": (QWEN15_MOE_A27B, 60, 4, 1408, 5632, False, 14_315_784_192, 2_689_173_504),
    "Mixtral-8x7B-Instruct-v0.1": (
        MIXTRAL_8X7B_INSTRUCT, 8, 2, 14336, 0, True, 46_702_792_704, 12_879_925_248,
    ),
}  # fmt: skip
# the model cards' rounded figures, in billions: total, active
CARDS = {
    "Qwen3-30B-A3B": (30.5, 3.3),
    "Qwen3-235B-A22B": (235, 22),
    "Qwen1.5-MoE-A2.7B": (14.3, 2.7),
    "Mixtral-8x7B-Instruct-v0.1": (46.7, 12.9),
}


@pytest.mark.parametrize("name", REAL)
def test_real_configs_resolve(name):
    raw, experts, top_k, width, shared, norm, total, active = REAL[name]
    cfg = ModelConfig.from_dict(raw)
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (experts, top_k, width)
    assert (moe.shared_expert_intermediate_size, moe.norm_topk_prob) == (shared, norm)
    assert moe.layers == tuple(range(cfg.num_layers))  # every layer MoE
    assert cfg.qkv_bias == (name == "Qwen1.5-MoE-A2.7B")
    assert cfg.qk_norm == name.startswith("Qwen3")
    counts = count_params(cfg)
    assert (counts.total, counts.active) == (total, active)
    card_total, card_active = CARDS[name]
    # the cards round down (Qwen3-30B-A3B: 3.35 B active is "3.3B")
    assert total / 1e9 == pytest.approx(card_total, rel=0.02)
    assert active / 1e9 == pytest.approx(card_active, rel=0.02)
    assert "B active a token" in counts.describe()
    assert is_large(cfg)  # every expert counted


def test_mixtral_block_and_expert_names():
    moe = ModelConfig.from_dict(MIXTRAL_8X7B_INSTRUCT).moe
    assert moe.block_name == "block_sparse_moe" and moe.expert_names == ("w1", "w3", "w2")


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_counts_equal_transformers_models(kind):
    from transformers import AutoModelForCausalLM

    hf_cfg = make_moe_config(kind)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg)
    raw = hf_cfg.to_dict() | {"architectures": [type(hf).__name__]}
    assert count_params(ModelConfig.from_dict(raw)).total == sum(p.numel() for p in hf.parameters())


def test_sparse_step_and_mlp_only_layers_pick_the_moe_layers():
    raw = dict(QWEN3_30B_A3B, num_hidden_layers=8, decoder_sparse_step=2, mlp_only_layers=[3, 4])
    cfg = ModelConfig.from_dict(raw)
    assert cfg.moe.layers == (1, 5, 7)  # (i + 1) % 2 == 0, but layer 3
    counts = count_params(cfg)
    dense = ModelConfig.from_dict(dict(raw, mlp_only_layers=list(range(8))))
    assert dense.moe is None  # no MoE layer left: a dense model
    assert count_params(dense).total == count_params(dense).active < counts.total


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"num_experts": None}, "needs num_experts"),
        ({"num_experts_per_tok": 129}, "num_experts_per_tok 129 must be in \\[1, number of "),
        ({"mlp_only_layers": [48]}, "mlp_only_layers has \\[48\\], not layer indices in"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step must be >= 1; got 0"),
    ],
)
def test_refusals_name_the_field(changes, match):
    raw = {k: v for k, v in {**QWEN3_30B_A3B, **changes}.items() if v is not None}
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_qwen2_moe_needs_its_shared_expert_width():
    raw = {k: v for k, v in QWEN15_MOE_A27B.items() if k != "shared_expert_intermediate_size"}
    with pytest.raises(ModelConfigError, match="needs shared_expert_intermediate_size"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize(
    "raw,tp,match",
    [
        (QWEN3_30B_A3B, 4, None),
        (QWEN15_MOE_A27B, 8, None),
        # 768 / 5 and Qwen1.5's 1408 / 3: the expert width; heads pass first where they divide
        (dict(QWEN3_30B_A3B, moe_intermediate_size=760), 16, "expert width "
         "\\(moe_intermediate_size\\) 760 does not split evenly over 16 ranks"),
        (dict(QWEN15_MOE_A27B, shared_expert_intermediate_size=5630), 4, "shared expert width "
         "\\(shared_expert_intermediate_size\\) 5630 does not split evenly over 4"),
        (dict(MIXTRAL_8X7B_INSTRUCT, intermediate_size=14330), 4, "expert width "
         "\\(intermediate_size\\) 14330 does not split"),
    ],
)  # fmt: skip
def test_tp_split_names_what_does_not_divide(raw, tp, match):
    cfg = ModelConfig.from_dict(raw)
    if match is None:
        part = partition_model(cfg, tp - 1, tp)
        assert part.moe_intermediate_size * tp == cfg.moe.intermediate_size
        assert part.shared_intermediate_size * tp == cfg.moe.shared_expert_intermediate_size
        return
    with pytest.raises(ModelConfigError, match=match):
        partition_model(cfg, 0, tp)


def test_pure_moe_model_ignores_its_unused_dense_width_under_tp():
    # Mixtral-like: every layer MoE; intermediate_size of a Qwen3-MoE is then never built
    cfg = ModelConfig.from_dict(dict(QWEN3_30B_A3B, intermediate_size=6145))
    assert partition_model(cfg, 1, 2).moe_intermediate_size == 384


def test_kernel_choice_moe():
    cfg = ModelConfig.from_dict(QWEN3_30B_A3B)
    cpu = torch.device("cpu")
    resolved = resolve_kernels(EngineConfig(device="cpu"), cfg, cpu)
    assert resolved.moe == "torch" and resolved.decode_norms == "off"
    with pytest.raises(ValueError, match="moe backend must be one of auto, triton, torch"):
        KernelPlan(moe="cutlass").validate()
    assert KernelPlan.reference().moe == "torch"
