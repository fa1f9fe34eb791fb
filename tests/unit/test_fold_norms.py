"""The folded decode weights of decode_norms "fold-all" (models/fused_decode.py): which copies
FusedDecode.prepare makes within its memory budget, and the mode the one-row decode then runs
(the mode it returns, which the runner's kernel config records)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")  # the folded weights are kernels/gemv.py's (rms_fold_weight)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from batchrun.kernels.gemv import pick_config  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from batchrun.config import KernelPlan  # noqa: E402
from batchrun.models import fused_decode  # noqa: E402
from batchrun.models.config import ModelConfig  # noqa: E402
from batchrun.models.loader import load_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama-fold")
    make_tiny_model("llama", path)
    return path


def tiny_model(model_dir: Path, decode_norms: str):
    """The tiny llama in fp16 with its decode matmuls on kernels/gemv.py and `decode_norms`."""
    cfg = ModelConfig.from_dir(model_dir)
    kernels = replace(KernelPlan.reference(), decode_gemv="triton", decode_norms=decode_norms)
    model = load_model(
        model_dir, cfg, "auto", torch.float16, "cpu", cfg.max_position_embeddings, kernels=kernels
    )
    # "fold-all" runs as "off" until prepare has made its folded weights
    mode = None if model.fused is None else model.fused.mode
    assert mode == {"off": None, "all": "all", "fold-all": "off"}[decode_norms]
    return model


def folded(model) -> bool:
    return model.fused is not None and bool(model.fused.qkv_rms or model.fused.gate_up_rms)


def test_fold_all_folds_both_norms_within_the_budget(model_dir):
    model = tiny_model(model_dir, "fold-all")
    assert not folded(model)  # made by prepare, not at construction
    assert fused_decode.prepare(model) == "fold-all"
    assert model.fused.mode == "fold-all" and folded(model)
    layer, fused = model.layers[1], model.fused
    want = layer.mlp.gate_up_proj.weight.float() * layer.post_attention_layernorm.weight.float()
    assert torch.equal(fused.gate_up_rms[1], want.to(torch.float16))
    want = layer.self_attn.qkv_proj.weight.float() * layer.input_layernorm.weight.float()
    assert torch.equal(fused.qkv_rms[1], want.to(torch.float16))


@pytest.mark.parametrize("mode", ["off", "all"])
def test_modes_without_folded_weights_make_none(model_dir, mode):
    model = tiny_model(model_dir, mode)
    assert fused_decode.prepare(model) == mode
    assert not folded(model)


def test_copies_over_the_budget_are_left_out(model_dir, monkeypatch):
    """Folded copies that do not fit the budget are not made: the one-row decode runs "off"."""
    model = tiny_model(model_dir, "fold-all")
    size = sum(
        layer.self_attn.qkv_proj.weight.nbytes + layer.mlp.gate_up_proj.weight.nbytes
        for layer in model.layers
    )
    monkeypatch.setattr(fused_decode, "fold_budget", lambda device: size - 1)
    assert fused_decode.prepare(model) == "off"
    assert model.fused.mode == "off" and not folded(model)
    assert not model.fused.takes(torch.zeros(1, model.config.hidden_size, dtype=torch.float16))


def test_pick_config_splits_narrow_matrices():
    """Matrices of at most 128 column tiles split along K to about 256 programs: llama-8b's
    qkv in 2 (96 tiles), o_proj and down_proj in 4; gate_up and the LM head never."""
    assert pick_config(1, 6144, 4096).split_k == 2
    assert pick_config(1, 4096, 4096).split_k == 4
    assert pick_config(1, 4096, 14336).split_k == 4
    assert pick_config(1, 3072, 2048).split_k == 4  # llama-1b's qkv
    assert pick_config(1, 28672, 4096).split_k == 1
    assert pick_config(1, 128256, 4096).split_k == 1
