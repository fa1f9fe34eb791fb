"""Tensor parallel for the hybrids on the CPU: TP=2 over gloo (two processes) gives TP=1's
greedy tokens and, within fp32 noise, its logits, for Qwen3.5 dense, Qwen3.5-MoE and Qwen3-Next
(tests/hybrid_models.py): each rank holds one of the two key heads of every linear layer (its
q / k / v conv channels, its two value heads' z, b, a, dt_bias, A_log and delta-rule states;
Qwen3-Next's fused in_proj_qkvz / in_proj_ba rows of its key head), out_proj row-parallel; the
gated attention's heads split as attention's do; the experts split along their width. A key-head
count that does not divide by the TP size is refused by name before any process starts. A
quantized checkpoint (compressed-tensors FP8 per channel, dynamic activations) splits its
weights and scales with them and gives TP=1's tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybrid_models import make_hybrid_model  # noqa: E402
from quant_model_checkpoints import quantize_saved  # noqa: E402
from tiny_models import random_prompts  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.engine_process.tp_launcher import start_tp_engine  # noqa: E402
from batchrun.errors import ModelConfigError  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

# fp32 on the CPU: the split matmuls only reorder sums
LOGITS_ATOL = 1e-4
NEW = 8


def config(model_dir: Path, **kw) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), device="cpu", dtype="float32", kv_budget=4096,
        chunked_prefill_size=32, **kw,
    )  # fmt: skip


def workload() -> list[GenerateRequest]:
    """Mixed lengths (chunked prefill of the long ones, states carried across chunks)."""
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(5, seed=3, min_len=2, max_len=90)
    return [GenerateRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]


def greedy(engine) -> dict[str, list[int]]:
    out = {}
    for res in engine.generate(workload()):
        assert res.finish_reason == "length" and not res.error, res
        out[res.rid] = res.output_ids
    return out


@pytest.mark.parametrize("kind", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def test_tp2_matches_tp1(kind, tmp_path):
    make_hybrid_model(kind, tmp_path)
    ref_engine = Engine(config(tmp_path))
    ref = greedy(ref_engine)
    probe = workload()[-1].input_ids
    ref_logits = ref_engine.score(probe)
    with start_tp_engine(config(tmp_path), tp_size=2, timeout_s=120, check_sync=True) as engine:
        states = engine.runner.states
        # rank 0's states: one of the two key heads' conv channels, two of the four value heads
        assert states.conv.shape[2] == (2 * 2 * 16 + 4 * 8) // 2
        assert states.ssm.shape[2] == 2
        assert greedy(engine) == ref
        logits = engine.score(probe)
        engine.check_integrity()
    torch.testing.assert_close(logits, ref_logits, atol=LOGITS_ATOL, rtol=0)


def test_key_heads_that_do_not_split_are_refused(tmp_path):
    make_hybrid_model("qwen3_5_text", tmp_path, linear_num_key_heads=1, linear_num_value_heads=2)
    with pytest.raises(ModelConfigError, match="1 key heads \\(linear_num_key_heads\\)"):
        start_tp_engine(config(tmp_path), tp_size=2)


def test_tp2_quantized_matches_tp1(tmp_path):
    hf = make_hybrid_model("qwen3_5_moe_text", tmp_path)
    ignore = ["lm_head", r"re:.*in_proj_(a|b)$", r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$"]
    quantize_saved(hf, "ct-fp8-channel", tmp_path, ignore)
    ref = greedy(Engine(config(tmp_path)))
    with start_tp_engine(config(tmp_path), tp_size=2, timeout_s=120, check_sync=True) as engine:
        layer = engine.runner.model.layers[0].self_attn
        assert layer.in_proj_qkv.quant is not None and layer.in_proj_b.quant is None
        assert greedy(engine) == ref
