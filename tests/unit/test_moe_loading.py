"""A mixture of experts' weights: per-expert checkpoint tensors stacked into w13 [E, 2I, H] and
w2 [E, H, I] exactly as transformers stacks them, from one file or shards with an index; each TP
rank holds its slices of the TP=1 weights (checkpoint and dummy); one all-reduce per MoE block;
a checkpoint that lacks or adds an expert says so."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_tp_partition import assert_rank_holds_its_slices  # noqa: E402
from tiny_models import MOE_KINDS, make_tiny_model  # noqa: E402

from batchrun.config import KernelPlan  # noqa: E402
from batchrun.errors import WeightLoadError  # noqa: E402
from batchrun.models.blocks.context import BuildContext  # noqa: E402
from batchrun.models.blocks.mlp import experts_or_dense  # noqa: E402
from batchrun.models.config import ModelConfig  # noqa: E402
from batchrun.models.loader import load_model  # noqa: E402
from batchrun.parallel.partition import partition_model  # noqa: E402
from batchrun.parallel.state import TPGroup  # noqa: E402


def load(model_dir, cfg: ModelConfig, load_format: str, tp: TPGroup | None = None):
    return load_model(model_dir, cfg, load_format, torch.float32, "cpu", 64, seed=3, tp=tp)


@pytest.fixture(scope="module", params=MOE_KINDS)
def saved(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(request.param, path)
    return path, hf


def test_experts_stacked_as_transformers_stacks_them(saved):
    path, hf = saved
    cfg = ModelConfig.from_dir(path)
    model = load(path, cfg, "safetensors")
    for i in cfg.moe.layers:
        ours, ref = model.layers[i].mlp, hf.model.layers[i].mlp
        assert torch.equal(ours.w13, ref.experts.gate_up_proj)
        assert torch.equal(ours.w2, ref.experts.down_proj)
        assert torch.equal(ours.gate.weight, ref.gate.weight)
        assert ours.gate.weight.dtype == torch.float32


def test_sharded_checkpoint_with_index(saved, tmp_path):
    path, _ = saved
    tensors = load_file(str(path / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors":
              names[1::2]}  # fmt: skip
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file))
        weight_map |= {n: file for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    cfg = ModelConfig.from_dir(tmp_path)
    one, sharded = load(path, cfg, "safetensors"), load(tmp_path, cfg, "safetensors")
    for (name, a), (_, b) in zip(one.named_parameters(), sharded.named_parameters()):
        assert torch.equal(a, b), name


def test_tp_ranks_hold_their_slices(saved):
    path, _ = saved
    cfg = ModelConfig.from_dir(path)
    for fmt in ("safetensors", "dummy"):
        full = load(path, cfg, fmt)
        ranks = [load(path, cfg, fmt, TPGroup(r, 2)) for r in range(2)]
        layer = cfg.moe.layers[0]
        w13 = ranks[1].layers[layer].mlp.w13
        assert w13.shape == (cfg.moe.num_experts, cfg.moe.intermediate_size, cfg.hidden_size)
        assert_rank_holds_its_slices(full, ranks)


@dataclass(frozen=True)
class CountingGroup(TPGroup):
    """Rank 0 of 2 without torch.distributed: counts all-reduces, sums nothing."""

    calls: list = None

    def all_reduce(self, x):
        self.calls.append(tuple(x.shape))
        return x


def test_one_all_reduce_per_moe_block():
    cfg = ModelConfig.from_dict(
        {**json.loads(_config_json("qwen2_moe")), "architectures": ["Qwen2MoeForCausalLM"]}
    )
    calls: list = []
    tp = CountingGroup(0, 2, None, calls)
    ctx = BuildContext(cfg, torch.float32, "cpu", KernelPlan.reference(), tp,
                       partition_model(cfg, 0, 2), cfg.max_position_embeddings)  # fmt: skip
    block = experts_or_dense(ctx, 0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    assert block.shared_expert is not None
    block(torch.randn(5, cfg.hidden_size))
    assert calls == [(5, cfg.hidden_size)]  # the experts and the shared expert together


def _config_json(kind: str) -> str:
    from tiny_models import make_hf_config

    return make_hf_config(kind).to_json_string()


def test_missing_and_extra_experts_are_named(saved, tmp_path):
    path, _ = saved
    cfg = ModelConfig.from_dir(path)
    tensors = load_file(str(path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    expert0 = next(n for n in tensors if ".experts.0." in n)
    missing = {n: t for n, t in tensors.items() if n != expert0}
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError, match="checkpoint lacks 1 tensors"):
        load(tmp_path, cfg, "safetensors")
    extra = dict(tensors)
    extra[expert0.replace(".experts.0.", f".experts.{cfg.moe.num_experts}.")] = tensors[expert0] + 0
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=f"is expert {cfg.moe.num_experts}, but config"):
        load(tmp_path, cfg, "safetensors")
