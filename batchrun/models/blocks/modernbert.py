"""ModernBERT's blocks (models/modernbert.py): a pre-norm encoder with
rotary positions, no token types, a GeGLU MLP, and bidirectional attention that is global every
`global_attn_every_n_layers` layers and local (|q - k| <= local_attention / 2) otherwise, each
kind with its own rotary base.

    x = LN(embed(ids))
    per layer:  x = x + Wo(attn(rotary(Wqkv(LN(x)))))
                x = x + Wo(act(in) * gate)     (in | gate = Wi(LN(x)))
    final LN;   classifier: LN(act(dense(pool(x)))) -> classifier   (pool: cls or mean)

The first layer's attention norm is the identity. Parameter names are the checkpoint's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.attention.varlen import varlen_attention
from batchrun.errors import ModelConfigError
from batchrun.pooling.heads import pool

_ACTIVATIONS = {"gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
_THETAS = {"full_attention": 160000.0, "sliding_attention": 10000.0}  # transformers' defaults


@dataclass(frozen=True)
class ModernBertConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    norm_eps: float
    norm_bias: bool
    attention_bias: bool
    mlp_bias: bool
    act: str
    layer_types: tuple[str, ...]  # full_attention / sliding_attention per layer
    half_window: int  # local_attention // 2
    thetas: dict[str, float]  # layer type -> rotary base
    max_position_embeddings: int
    num_labels: int
    classifier_pooling: str
    classifier_act: str
    classifier_bias: bool

    @classmethod
    def from_dict(cls, raw: dict[str, Any], num_labels: int, source: str) -> ModernBertConfig:
        n = int(raw["num_hidden_layers"])
        every = int(raw.get("global_attn_every_n_layers", 3))
        types = raw.get("layer_types") or [
            "sliding_attention" if i % every else "full_attention" for i in range(n)
        ]
        rope = raw.get("rope_parameters") or {}
        thetas = {}
        for kind, default in _THETAS.items():
            params = rope.get(kind) or {}
            if params.get("rope_type", "default") != "default":
                raise ModelConfigError(
                    f"{source}: ModernBERT rope type {params['rope_type']!r} is not supported "
                    "(supported: default)"
                )
            legacy = raw.get(
                "global_rope_theta" if kind == "full_attention" else "local_rope_theta"
            )
            thetas[kind] = float(params.get("rope_theta") or legacy or default)
        acts = (raw.get("hidden_activation", "gelu"), raw.get("classifier_activation", "gelu"))
        for act in acts:
            if act not in _ACTIVATIONS:
                raise ModelConfigError(
                    f"{source}: ModernBERT activation {act!r} is not supported (supported: "
                    f"{', '.join(_ACTIVATIONS)})"
                )
        pooling = raw.get("classifier_pooling", "cls")
        if pooling not in ("cls", "mean"):
            raise ModelConfigError(
                f"{source}: classifier_pooling {pooling!r} is not supported (supported: cls, mean)"
            )
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_heads=int(raw["num_attention_heads"]),
            norm_eps=float(raw.get("norm_eps", 1e-5)),
            norm_bias=bool(raw.get("norm_bias", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            act=acts[0],
            layer_types=tuple(types),
            half_window=int(raw.get("local_attention", 128)) // 2,
            thetas=thetas,
            max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
            num_labels=num_labels,
            classifier_pooling=pooling,
            classifier_act=acts[1],
            classifier_bias=bool(raw.get("classifier_bias", False)),
        )

    @property
    def max_tokens(self) -> int:
        return self.max_position_embeddings


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotate-half rotary of x [T, H, D] by cos, sin [T, 1, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class _Layer(nn.Module):
    def __init__(self, cfg: ModernBertConfig, i: int):
        super().__init__()
        h = cfg.hidden_size

        def norm():
            return nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias, device="meta")

        self.attn_norm = nn.Identity() if i == 0 else norm()
        self.attn = nn.Module()
        self.attn.Wqkv = nn.Linear(h, 3 * h, bias=cfg.attention_bias, device="meta")
        self.attn.Wo = nn.Linear(h, h, bias=cfg.attention_bias, device="meta")
        self.mlp_norm = norm()
        self.mlp = nn.Module()
        self.mlp.Wi = nn.Linear(h, 2 * cfg.intermediate_size, bias=cfg.mlp_bias, device="meta")
        self.mlp.Wo = nn.Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias, device="meta")
        self.kind = cfg.layer_types[i]
        self.half_window = cfg.half_window if self.kind == "sliding_attention" else 0
        self.num_heads, self.head_dim = cfg.num_heads, h // cfg.num_heads
        self.act = _ACTIVATIONS[cfg.act]

    def forward(self, x, seq_lens, cos, sin):
        qkv = self.attn.Wqkv(self.attn_norm(x)).view(-1, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)  # [T, H, D]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        scale = self.head_dim**-0.5
        a = varlen_attention(q, k, v, seq_lens, scale, causal=False, half_window=self.half_window)
        x = x + self.attn.Wo(a)
        y, gate = self.mlp.Wi(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.mlp.Wo(self.act(y) * gate)


class ModernBert(nn.Module):
    def __init__(self, cfg: ModernBertConfig):
        super().__init__()
        h = cfg.hidden_size
        self.config = cfg
        self.embeddings = nn.Module()
        self.embeddings.tok_embeddings = nn.Embedding(cfg.vocab_size, h, device="meta")
        self.embeddings.norm = nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias, device="meta")
        self.layers = nn.ModuleList(_Layer(cfg, i) for i in range(len(cfg.layer_types)))
        self.final_norm = nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias, device="meta")
        if cfg.num_labels:
            self.head = nn.Module()
            self.head.dense = nn.Linear(h, h, bias=cfg.classifier_bias, device="meta")
            self.head.norm = nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias, device="meta")
            self.classifier = nn.Linear(h, cfg.num_labels, device="meta")

    def _cos_sin(self, positions: torch.Tensor, kind: str, dtype: torch.dtype):
        d = self.config.hidden_size // self.config.num_heads
        theta = self.config.thetas[kind]
        inv_freq = 1.0 / theta ** (
            torch.arange(0, d, 2, dtype=torch.int64, device=positions.device).float() / d
        )
        freqs = positions[:, None].float() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.inference_mode()
    def hidden_states(self, input_ids, seq_lens, token_type_ids=None) -> torch.Tensor:
        x = self.embeddings.norm(self.embeddings.tok_embeddings(input_ids))
        positions = torch.cat([torch.arange(n, device=input_ids.device) for n in seq_lens])
        tables = {kind: self._cos_sin(positions, kind, x.dtype) for kind in _THETAS}
        for layer in self.layers:
            x = layer(x, seq_lens, *tables[layer.kind])
        return self.final_norm(x)

    @torch.inference_mode()
    def classify(self, hidden: torch.Tensor, seq_lens: tuple[int, ...]) -> torch.Tensor:
        pooled = pool(hidden, seq_lens, self.config.classifier_pooling).to(hidden.dtype)
        act = _ACTIVATIONS[self.config.classifier_act]
        return self.classifier(self.head.norm(act(self.head.dense(pooled))))
