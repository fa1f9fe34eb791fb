"""The folded decode weights of decode_norms "fold" and "fold-all": which copies
LlamaForCausalLM.prepare_decode_norms makes within its memory budget, and the mode the one-row
decode then runs (the mode it returns, which the runner's kernel config records)."""

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

import batchrun.models.llama as llama  # noqa: E402
from batchrun.config import KernelConfig  # noqa: E402
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
    kernels = replace(KernelConfig.reference(), decode_gemv="triton", decode_norms=decode_norms)
    model = load_model(
        model_dir, cfg, "auto", torch.float16, "cpu", cfg.max_position_embeddings, kernels=kernels
    )
    # a mode with folded weights runs as "post" until prepare_decode_norms has made them
    assert model.decode_norms == ("post" if decode_norms in ("fold", "fold-all") else decode_norms)
    return model


def folded(model) -> tuple[bool, bool]:
    layer = model.layers[0]
    return hasattr(layer.self_attn, "qkv_weight_rms"), hasattr(layer.mlp, "gate_up_weight_rms")


def test_fold_all_folds_both_norms_within_the_budget(model_dir):
    model = tiny_model(model_dir, "fold-all")
    assert folded(model) == (False, False)  # made by prepare_decode_norms, not at construction
    assert model.prepare_decode_norms() == "fold-all"
    assert model.decode_norms == "fold-all" and folded(model) == (True, True)
    layer = model.layers[1]
    want = layer.mlp.gate_up_proj.weight.float() * layer.post_attention_layernorm.weight.float()
    assert torch.equal(layer.mlp.gate_up_weight_rms, want.to(torch.float16))
    want = layer.self_attn.qkv_proj.weight.float() * layer.input_layernorm.weight.float()
    assert torch.equal(layer.self_attn.qkv_weight_rms, want.to(torch.float16))


def test_fold_makes_only_the_qkv_copies(model_dir):
    model = tiny_model(model_dir, "fold")
    assert model.prepare_decode_norms() == "fold"
    assert folded(model) == (True, False)


@pytest.mark.parametrize("mode", ["off", "all", "post"])
def test_modes_without_folded_weights_make_none(model_dir, mode):
    model = tiny_model(model_dir, mode)
    assert model.prepare_decode_norms() == mode
    assert model.decode_norms == mode and folded(model) == (False, False)


def test_copies_over_the_budget_are_left_out(model_dir, monkeypatch):
    """gate_up's copy goes first, then qkv's; the one-row decode then runs "fold", or "post"."""
    model = tiny_model(model_dir, "fold-all")
    qkv = sum(layer.self_attn.qkv_proj.weight.nbytes for layer in model.layers)
    monkeypatch.setattr(llama, "fold_budget", lambda device: qkv + 1)
    assert model.prepare_decode_norms() == "fold"
    assert model.decode_norms == "fold" and folded(model) == (True, False)

    monkeypatch.setattr(llama, "fold_budget", lambda device: qkv - 1)
    for mode in ("fold-all", "fold"):
        model = tiny_model(model_dir, mode)
        assert model.prepare_decode_norms() == "post", mode
        assert model.decode_norms == "post" and folded(model) == (False, False), mode


def test_pick_config_splits_narrow_matrices():
    """Matrices of at most 128 column tiles split along K to about 256 programs: llama-8b's
    qkv in 2 (96 tiles), o_proj and down_proj in 4; gate_up and the LM head never."""
    assert pick_config(1, 6144, 4096).split_k == 2
    assert pick_config(1, 4096, 4096).split_k == 4
    assert pick_config(1, 4096, 14336).split_k == 4
    assert pick_config(1, 3072, 2048).split_k == 4  # llama-1b's qkv
    assert pick_config(1, 28672, 4096).split_k == 1
    assert pick_config(1, 128256, 4096).split_k == 1
