"""gpt-oss's weights: the stacked expert tensors (plain and MXFP4, the blocks and scales in two
shard files) load into w13 / b13 as [gate | up] of transformers' interleaved gate_up_proj, and
w2 / b2 as its down_proj transposed; each TP rank holds its slices of the TP=1 weights; an MXFP4
weight whose scales are missing is named."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gptoss_models import save_mxfp4  # noqa: E402
from test_tp_partition import assert_rank_holds_its_slices  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from batchrun.errors import WeightLoadError  # noqa: E402
from batchrun.models.config import ModelConfig  # noqa: E402
from batchrun.models.loader import load_model  # noqa: E402
from batchrun.parallel.state import TPGroup  # noqa: E402


def load(model_dir, tp: TPGroup | None = None):
    cfg = ModelConfig.from_dir(model_dir)
    return load_model(model_dir, cfg, "safetensors", torch.float32, "cpu", 64, tp=tp)


@pytest.fixture(scope="module", params=["plain", "mxfp4"])
def saved(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model("gpt_oss", path)
    if request.param == "mxfp4":
        save_mxfp4(hf, path)
    return path, hf


def test_experts_as_transformers_holds_them(saved):
    path, hf = saved
    model = load(path)
    for ours, ref in zip(model.layers, hf.model.layers):
        mlp, experts = ours.mlp, ref.mlp.experts
        gate_up = experts.gate_up_proj.transpose(1, 2)  # [E, 2I, H] interleaved
        assert torch.equal(mlp.w13, torch.cat([gate_up[:, ::2], gate_up[:, 1::2]], dim=1))
        assert torch.equal(mlp.w2, experts.down_proj.transpose(1, 2))
        bias = experts.gate_up_proj_bias
        assert torch.equal(mlp.b13, torch.cat([bias[:, ::2], bias[:, 1::2]], dim=1))
        assert torch.equal(mlp.b2, experts.down_proj_bias)
        assert torch.equal(mlp.gate.bias, ref.mlp.router.bias)
        assert torch.equal(ours.self_attn.sinks, ref.self_attn.sinks)


def test_tp_ranks_hold_their_slices(saved):
    path, _ = saved
    full = load(path)
    assert_rank_holds_its_slices(full, [load(path, TPGroup(r, 2)) for r in range(2)])


def test_blocks_and_scales_in_two_shards_and_a_missing_scale(tmp_path_factory):
    path = tmp_path_factory.mktemp("mxfp4")
    save_mxfp4(make_tiny_model("gpt_oss", path), path)
    tensors = load_file(str(path / "model.safetensors"))
    scales = sorted(n for n in tensors if n.endswith("_scales"))
    files = {"model-00001-of-00002.safetensors": [n for n in tensors if n not in scales],
             "model-00002-of-00002.safetensors": scales}  # fmt: skip
    sharded = tmp_path_factory.mktemp("sharded")
    for file, names in files.items():
        save_file({n: tensors[n] for n in names}, str(sharded / file))
    weight_map = {n: f for f, names in files.items() for n in names}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (sharded / "config.json").write_text((path / "config.json").read_text())
    one, two = load(path), load(sharded)
    for (name, a), (_, b) in zip(one.named_parameters(), two.named_parameters()):
        assert torch.equal(a, b), name

    del tensors[scales[0]]
    (path / "model.safetensors").unlink()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=scales[0].removesuffix("_scales")):
        load(path)
