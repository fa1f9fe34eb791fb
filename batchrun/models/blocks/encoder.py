"""Post-norm encoder blocks (BERT's and XLM-RoBERTa's: models/bert.py, models/xlm_roberta.py)
with their sequence-classification heads (cross-encoders): absolute positions, token types, and
bidirectional attention within each packed sequence (attention/varlen.py):

    x = LN(word + position + token_type)
    per layer:  x = LN(x + o(attn(qkv(x))));  x = LN(x + down(gelu(up(x))))

XLM-RoBERTa differs from BERT in its positions only: they start at pad_token_id + 1. Parameter
names are the checkpoint's (the base model's), so the weights load by name; a classification head
reads the first token: BERT's through its pooler (tanh) into `classifier`, XLM-RoBERTa's through
`classifier.dense` (tanh) into `classifier.out_proj`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.attention.varlen import varlen_attention
from batchrun.errors import ModelConfigError

ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    position_offset: int  # XLM-RoBERTa: pad_token_id + 1; BERT: 0
    num_labels: int  # 0: no classification head

    @classmethod
    def from_dict(cls, raw: dict[str, Any], roberta: bool, num_labels: int, source: str):
        act = raw.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ModelConfigError(
                f"{source}: hidden_act {act!r} is not supported for an encoder (supported: "
                f"{', '.join(ACTIVATIONS)})"
            )
        pos = raw.get("position_embedding_type", "absolute")
        if pos != "absolute":
            raise ModelConfigError(
                f"{source}: position_embedding_type {pos!r} is not supported (supported: absolute)"
            )
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=int(raw["num_attention_heads"]),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            hidden_act=act,
            position_offset=int(raw.get("pad_token_id", 1)) + 1 if roberta else 0,
            num_labels=num_labels,
        )

    @property
    def max_tokens(self) -> int:
        """The longest sequence the position table covers."""
        return self.max_position_embeddings - self.position_offset


def _linear(rows: int, cols: int) -> nn.Linear:
    return nn.Linear(cols, rows, device="meta")


class _Embeddings(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h, device="meta")
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h, device="meta")
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, h, device="meta")
        self.LayerNorm = nn.LayerNorm(h, eps=cfg.layer_norm_eps, device="meta")


class _Layer(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        h, inter, eps = cfg.hidden_size, cfg.intermediate_size, cfg.layer_norm_eps
        self.attention = nn.Module()
        self.attention.self = nn.Module()
        for name in ("query", "key", "value"):
            setattr(self.attention.self, name, _linear(h, h))
        self.attention.output = nn.Module()
        self.attention.output.dense = _linear(h, h)
        self.attention.output.LayerNorm = nn.LayerNorm(h, eps=eps, device="meta")
        self.intermediate = nn.Module()
        self.intermediate.dense = _linear(inter, h)
        self.output = nn.Module()
        self.output.dense = _linear(h, inter)
        self.output.LayerNorm = nn.LayerNorm(h, eps=eps, device="meta")
        self.num_heads, self.head_dim = cfg.num_heads, h // cfg.num_heads
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, seq_lens: tuple[int, ...]) -> torch.Tensor:
        s = self.attention.self
        q, k, v = (p(x).view(-1, self.num_heads, self.head_dim) for p in (s.query, s.key, s.value))
        a = varlen_attention(q, k, v, seq_lens, self.head_dim**-0.5, causal=False)  # [T, hidden]
        out = self.attention.output
        x = out.LayerNorm(x + out.dense(a))
        y = self.output.dense(self.act(self.intermediate.dense(x)))
        return self.output.LayerNorm(x + y)


class Encoder(nn.Module):
    """The encoder and, with cfg.num_labels, its classification head; `roberta`: XLM-RoBERTa's
    head (classifier.dense -> classifier.out_proj) instead of BERT's (pooler -> classifier)."""

    def __init__(self, cfg: EncoderConfig, roberta: bool):
        super().__init__()
        self.config, self.roberta = cfg, roberta
        self.embeddings = _Embeddings(cfg)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))
        h = cfg.hidden_size
        if cfg.num_labels and roberta:
            self.classifier = nn.Module()
            self.classifier.dense = _linear(h, h)
            self.classifier.out_proj = _linear(cfg.num_labels, h)
        elif cfg.num_labels:
            self.pooler = nn.Module()
            self.pooler.dense = _linear(h, h)
            self.classifier = _linear(cfg.num_labels, h)

    def positions(self, seq_lens: tuple[int, ...], device) -> torch.Tensor:
        return torch.cat([torch.arange(n, device=device) for n in seq_lens]) + (
            self.config.position_offset
        )

    @torch.inference_mode()
    def hidden_states(
        self, input_ids: torch.Tensor, seq_lens: tuple[int, ...], token_type_ids=None
    ) -> torch.Tensor:
        """The last layer's hidden states [T, hidden] of the packed sequences."""
        e = self.embeddings
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = (
            e.word_embeddings(input_ids)
            + e.position_embeddings(self.positions(seq_lens, input_ids.device))
            + e.token_type_embeddings(types)
        )
        x = e.LayerNorm(x)
        for layer in self.encoder.layer:
            x = layer(x, seq_lens)
        return x

    @torch.inference_mode()
    def classify(self, hidden: torch.Tensor, seq_lens: tuple[int, ...]) -> torch.Tensor:
        """The head's logits [B, num_labels] from each sequence's first token."""
        starts = torch.tensor([0, *seq_lens[:-1]], device=hidden.device).cumsum(0)
        first = hidden[starts]
        if self.roberta:
            return self.classifier.out_proj(torch.tanh(self.classifier.dense(first)))
        return self.classifier(torch.tanh(self.pooler.dense(first)))
