"""The folded decode weights ("fold", "fold-all"): which copies LlamaForCausalLM.fold_norms makes
within its memory budget, and the mode a one-row decode falls back to without them."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from batchrun.kernels.gemv import pick_config  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

import batchrun.models.llama as llama  # noqa: E402
from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.models.layers import GEMV_NORM_ENV, norm_fusion_mode  # noqa: E402


def tiny_model(tmp_path):
    make_tiny_model("llama", tmp_path)
    engine = Engine(EngineConfig(model=str(tmp_path), device="cpu", dtype="float16", kv_budget=64))
    return engine.runner.model


def folded(model) -> tuple[bool, bool]:
    layer = model.layers[0]
    return hasattr(layer.self_attn, "qkv_weight_rms"), hasattr(layer.mlp, "gate_up_weight_rms")


def test_fold_all_folds_both_norms_within_the_budget(tmp_path, monkeypatch):
    model = tiny_model(tmp_path)
    model.fold_norms(post=True)
    assert folded(model) == (True, True)
    layer = model.layers[1]
    want = layer.mlp.gate_up_proj.weight.float() * layer.post_attention_layernorm.weight.float()
    assert torch.equal(layer.mlp.gate_up_weight_rms, want.to(torch.float16))
    monkeypatch.setenv(GEMV_NORM_ENV, "fold-all")
    x = torch.zeros(1, model.config.hidden_size, dtype=torch.float16)
    monkeypatch.setattr(llama, "gemv_norm_fusion", lambda x, mode: norm_fusion_mode(x.shape[-1]))
    assert model._norms_in_gemv(x) == "fold-all"


def test_copies_over_the_budget_are_left_out(tmp_path, monkeypatch):
    """gate_up's copy goes first, then qkv's; the one-row decode then runs "fold", or "post"."""
    model = tiny_model(tmp_path)
    qkv = sum(layer.self_attn.qkv_proj.weight.nbytes for layer in model.layers)
    monkeypatch.setattr(llama, "gemv_norm_fusion", lambda x, mode: "fold-all")
    x = torch.zeros(1, model.config.hidden_size, dtype=torch.float16)
    monkeypatch.setattr(llama, "fold_budget", lambda device: qkv + 1)
    model.fold_norms(post=True)
    assert folded(model) == (True, False)
    assert model._norms_in_gemv(x) == "fold"

    model = tiny_model(tmp_path / "b")
    monkeypatch.setattr(llama, "fold_budget", lambda device: qkv - 1)
    model.fold_norms(post=True)
    assert folded(model) == (False, False)
    assert model._norms_in_gemv(x) == "post"


def test_the_width_rule_folds_wide_models(monkeypatch):
    monkeypatch.delenv(GEMV_NORM_ENV, raising=False)
    assert norm_fusion_mode(2048) == "all"
    assert norm_fusion_mode(4096) == "fold-all"
    monkeypatch.setenv(GEMV_NORM_ENV, "fold")
    assert norm_fusion_mode(4096) == "fold"


def test_pick_config_splits_narrow_matrices():
    """Matrices of at most 128 column tiles split along K to about 256 programs: llama-8b's
    qkv in 2 (96 tiles), o_proj and down_proj in 4; gate_up and the LM head never."""
    assert pick_config(1, 6144, 4096).split_k == 2
    assert pick_config(1, 4096, 4096).split_k == 4
    assert pick_config(1, 4096, 14336).split_k == 4
    assert pick_config(1, 3072, 2048).split_k == 4  # llama-1b's qkv
    assert pick_config(1, 28672, 4096).split_k == 1
    assert pick_config(1, 128256, 4096).split_k == 1
