"""Decoders for prefill-only tasks, built from the registry's blocks (models/registry.py):

    <Arch>Model                      the base model (Qwen3-Embedding, gte-Qwen2, e5-mistral): its
                                     final hidden states, pooled by the folder's or --pooling
    <Arch>ForSequenceClassification  a `score` linear over the last token (reward models)
    <Arch>ForCausalLM                a yes/no reranker (Qwen3-Reranker): two LM-head rows at the
                                     last token

Each maps onto its causal architecture's spec (<Arch>ForCausalLM); the base model's checkpoint
names lack `model.` (Qwen3Model saves `layers.0...`), which the tensor names below put back. The
LM head is built only for a reranker; `score` is read here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchrun.errors import ModelConfigError, WeightLoadError
from batchrun.models.blocks.model import CausalLM
from batchrun.models.checkpoint import Checkpoint
from batchrun.models.config import ModelConfig
from batchrun.models.dummy import init_dummy_
from batchrun.models.loader import _check_complete, _load_plain, build_model
from batchrun.models.registry import ARCHITECTURES
from batchrun.models.spec import TensorNames
from batchrun.pooling.shared_prefix import PrefixPlan
from batchrun.pooling.varlen import VarlenBackend

_SUFFIXES = ("Model", "ForSequenceClassification", "ForCausalLM")
# a base model's top-level names -> the causal LM's; the heads batchrun reads itself are skipped
_BASE_NAMES = TensorNames(
    renames=(
        ("layers.", "model.layers."),
        ("embed_tokens.", "model.embed_tokens."),
        ("norm.", "model.norm."),
    ),
    skipped=("score.",),
)


def causal_architecture(arch: str) -> tuple[str, str] | None:
    """(the causal architecture, the head: base / classify / lm) of a decoder architecture
    name; None where it is no decoder the registry builds."""
    for suffix, head in zip(_SUFFIXES, ("base", "classify", "lm"), strict=True):
        if arch.endswith(suffix):
            base = arch[: -len(suffix)]
            # a multimodal family's text model (<Family>TextModel) is its causal LM's decoder
            for causal in (base + "ForCausalLM", base.removesuffix("Text") + "ForCausalLM"):
                if causal in ARCHITECTURES:
                    return causal, head
            return None
    return None


class DecoderPooler(nn.Module):
    """A decoder's blocks run over packed sequences with causal attention and no KV cache."""

    def __init__(self, lm: CausalLM, score: nn.Linear | None):
        super().__init__()
        self.lm, self.score = lm, score

    @torch.inference_mode()
    def hidden_states(self, plan: PrefixPlan) -> torch.Tensor:
        """The final norm's output [T, hidden] of the plan's packed tokens (each shared prefix
        once: pooling/shared_prefix.py)."""
        lm, device = self.lm, self.lm.embed_tokens.weight.device
        input_ids = torch.tensor(plan.input_ids, device=device)
        positions = torch.tensor(plan.positions, device=device)
        kv_rows = None if plan.kv_rows is None else torch.tensor(plan.kv_rows, device=device)
        backend = VarlenBackend(plan, kv_rows)
        x, residual = lm.embed(input_ids), None
        for i in range(len(lm.layers)):
            q, k, v, residual = lm.piece(i, x, residual)
            x = lm.attention(i, q, k, v, positions, backend)
        x, residual = lm.piece(len(lm.layers), x, residual)
        return lm.norm.forward_with_residual(x, residual)[0]

    @torch.inference_mode()
    def classify(self, last: torch.Tensor) -> torch.Tensor:
        """The score head's logits [B, num_labels] of the sequences' last hidden states [B, h]."""
        return self.score(last)

    @torch.inference_mode()
    def token_logits(self, last: torch.Tensor, token_ids: tuple[int, ...]) -> torch.Tensor:
        """The LM head's logits [B, len(token_ids)] of `token_ids` at the last hidden states."""
        rows = self.lm.lm_head_weight[list(token_ids)]
        return last @ rows.T


def load_decoder(
    model_dir: Path | None,
    raw: dict[str, Any],
    arch: str,
    num_labels: int,
    dtype: torch.dtype,
    device: str,
    load_format: str = "auto",
) -> tuple[DecoderPooler, ModelConfig]:
    """The decoder `arch` of config.json `raw` with its head, weights from `model_dir` (or
    random with load_format "dummy")."""
    causal, head = causal_architecture(arch)  # type: ignore[misc]
    # NOTE: no LM head unless the task reads one (a reranker's yes/no rows)
    tied = True if head != "lm" else raw.get("tie_word_embeddings", False)
    cfg = ModelConfig.from_dict(
        {**raw, "architectures": [causal], "tie_word_embeddings": tied}, str(model_dir)
    )
    if cfg.quantization is not None:
        raise ModelConfigError(
            f"{model_dir}: a quantized checkpoint is not supported for embed / rerank / score / "
            "classify; batchrun runs them from bf16 / fp16 / fp32 weights"
        )
    max_pos = cfg.max_position_embeddings
    lm = build_model(cfg, dtype, device, max_pos)
    score = None
    if head == "classify":
        score = nn.Linear(cfg.hidden_size, num_labels, bias=False, dtype=dtype, device=device)
    if load_format == "dummy":
        init_dummy_(lm, "normal", seed=0, shards=lm.param_shards())
        if score is not None:
            init_dummy_(score, "normal", seed=1)
    else:
        with Checkpoint(model_dir, _BASE_NAMES) as ckpt:
            _check_complete(lm, ckpt, _load_plain(lm, ckpt, cfg))
            if score is not None:
                _load_score(score, model_dir)
    return DecoderPooler(lm.eval(), score), cfg


def _load_score(score: nn.Linear, model_dir: Path) -> None:
    with Checkpoint(model_dir) as ckpt:
        if "score.weight" not in ckpt:
            raise WeightLoadError(
                f"{model_dir}: a sequence-classification checkpoint without score.weight"
            )
        weight = ckpt.get("score.weight")
    if tuple(weight.shape) != tuple(score.weight.shape):
        raise WeightLoadError(
            f"{model_dir}: score.weight has shape {tuple(weight.shape)}, expected "
            f"{tuple(score.weight.shape)} from config.json's labels"
        )
    with torch.no_grad():
        score.weight.copy_(weight)
