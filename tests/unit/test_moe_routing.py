"""The MoE block's routing and experts against transformers' own modules: the router on crafted
logits (ties, renormalization or not), the per-expert loop on random weights, the Router's fp32
logits and the whole block (a shared expert included) in a model's dtype."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_moe_config  # noqa: E402

from batchrun.config import KernelPlan  # noqa: E402
from batchrun.layers.moe import moe_experts, route  # noqa: E402
from batchrun.models.blocks.context import BuildContext  # noqa: E402
from batchrun.models.blocks.mlp import experts_or_dense  # noqa: E402
from batchrun.models.config import ModelConfig  # noqa: E402
from batchrun.parallel.partition import partition_model  # noqa: E402
from batchrun.parallel.state import TPGroup  # noqa: E402

ROUTERS = {  # kind -> transformers' router class (module, name)
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter"),
    "qwen2_moe": ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeTopKRouter"),
    "mixtral": ("transformers.models.mixtral.modeling_mixtral", "MixtralTopKRouter"),
}


def crafted_logits(num_experts: int) -> torch.Tensor:
    """Rows with ties at and across the top-k boundary, all-equal rows, a dominant expert, and
    random rows."""
    rows = [
        torch.zeros(num_experts),  # every expert tied
        torch.tensor([1.0, 1.0] + [0.5] * (num_experts - 2)),  # a tie inside the top 2
        torch.tensor([0.5] * (num_experts - 3) + [2.0, 2.0, 2.0]),  # three tied at the end
        torch.tensor([3.0] + [1.0] * (num_experts - 1)),  # a tie across the boundary
        torch.arange(num_experts, dtype=torch.float32).flip(0) * 10,  # one expert dominates
    ]
    g = torch.Generator().manual_seed(0)
    rows += list(torch.randn(16, num_experts, generator=g) * 3)
    return torch.stack(rows)


def hf_router(kind: str, top_k: int, norm: bool, num_experts: int):
    import importlib

    module, name = ROUTERS[kind]
    extra = {} if kind == "mixtral" else {"norm_topk_prob": norm}
    num = {"num_local_experts" if kind == "mixtral" else "num_experts": num_experts}
    cfg = make_moe_config(kind, hidden_size=num_experts, num_experts_per_tok=top_k, **num, **extra)
    router = getattr(importlib.import_module(module), name)(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.eye(num_experts))  # logits = the input itself
    return router


@pytest.mark.parametrize(
    "kind,num_experts,top_k,norm",
    [
        ("qwen3_moe", 8, 2, True),
        ("qwen3_moe", 8, 4, False),
        ("qwen2_moe", 6, 3, False),
        ("qwen2_moe", 6, 1, True),
        ("mixtral", 8, 2, True),
    ],
)
def test_route_equals_transformers_router(kind, num_experts, top_k, norm):
    logits = crafted_logits(num_experts)
    _, ref_weights, ref_ids = hf_router(kind, top_k, norm, num_experts)(logits)
    weights, ids = route(logits, top_k, norm)
    assert weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    assert torch.equal(weights, ref_weights.float())
    if norm:
        torch.testing.assert_close(weights.sum(-1), torch.ones(len(logits)))


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_experts_loop_equals_transformers_experts(kind):
    import importlib

    module, _ = ROUTERS[kind]
    name = "MixtralExperts" if kind == "mixtral" else "Qwen3MoeExperts"
    cfg = make_moe_config(kind)
    experts = getattr(importlib.import_module(module), name)(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) * 0.1)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * 0.1)
    x = torch.randn(37, cfg.hidden_size, generator=g)
    logits = torch.randn(37, experts.num_experts, generator=g)
    logits[:, -1] = -1e9  # one expert no token picks
    weights, ids = route(logits, cfg.num_experts_per_tok, True)
    ref = experts(x, ids, weights)
    out = moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, "torch")
    assert torch.equal(out, ref)  # the same sums in the same order
    w13, w2 = experts.gate_up_proj, experts.down_proj
    assert moe_experts(x[:0], w13, w2, weights[:0], ids[:0], "torch").shape == (0, x.shape[1])


def test_moe_experts_refuses_an_unknown_backend():
    x, w13, w2 = torch.zeros(1, 4), torch.zeros(2, 4, 4), torch.zeros(2, 4, 2)
    with pytest.raises(ValueError, match="moe backend must be torch or triton; got 'cuda'"):
        moe_experts(x, w13, w2, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long), "cuda")


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
def test_block_equals_transformers_sparse_moe_block_in_bf16(kind):
    """The whole block in bf16: the router's logits in fp32 (transformers' in bf16, so the
    weights may round differently: compared within bf16's precision), the shared expert and its
    sigmoid gate."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf_cfg = make_moe_config(kind, num_hidden_layers=1, mlp_only_layers=[])
    hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    ref_block = hf.model.layers[0].mlp
    cfg = ModelConfig.from_dict(hf_cfg.to_dict() | {"architectures": [type(hf).__name__]})
    ctx = BuildContext(cfg, torch.float32, "cpu", KernelPlan.reference(), TPGroup(),
                       partition_model(cfg), cfg.max_position_embeddings)  # fmt: skip
    block = experts_or_dense(ctx, 0)
    with torch.no_grad():
        block.gate.weight.copy_(ref_block.gate.weight)
        block.w13.copy_(ref_block.experts.gate_up_proj)
        block.w2.copy_(ref_block.experts.down_proj)
        if block.shared_expert is not None:
            shared = ref_block.shared_expert
            block.shared_expert.gate_up_proj.weight.copy_(
                torch.cat([shared.gate_proj.weight, shared.up_proj.weight])
            )
            block.shared_expert.down_proj.weight.copy_(shared.down_proj.weight)
            block.shared_expert_gate.weight.copy_(ref_block.shared_expert_gate.weight)
    x = torch.randn(1, 23, cfg.hidden_size)
    with torch.no_grad():
        ref = ref_block(x)[0]
        # fp32: the fused gate_up matmul of the shared expert only reorders sums
        torch.testing.assert_close(block(x[0]), ref, atol=1e-5, rtol=1e-5)
        block.to(torch.bfloat16)
        block.gate.float()  # the router stays fp32, as the model builds it
        out = block(x[0].bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
