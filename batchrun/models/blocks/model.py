"""CausalLM: embeddings, decoder layers, the final norm and the LM head, with one forward for
every step. Tokens of all requests are flattened into one [T, hidden] batch; attention goes
through an `AttentionBackend`.

The forward is written in pieces around the attentions (`piece`, `attention`), the ones the
piecewise CUDA graphs (engine/piecewise_graph.py) capture and run eagerly between:

    x = embed(input_ids)
    piece 0         layer 0's pre-attention half                 -> q, k, v, residual
    attention 0     rotary and attention over the paged KV       -> out
    piece i         layer i-1's post-attention half, layer i's pre-attention half
    ...
    piece L         layer L-1's post-attention half              -> hidden, residual
    logits          the final norm and the LM head over the rows wanted

A one-row decode step may run the fused decode instead (models/fused_decode.py), where its
kernel plan turns it on.

Tensor parallel (`tp`, see batchrun/parallel): each rank holds its heads and MLP columns and a
slice of the vocabulary; logits are all-gathered, so every rank returns the full [S, vocab] and
samples the same tokens. The default TPGroup() is TP=1, a plain model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from batchrun.attention.base import AttentionBackend
from batchrun.layers.linear import ColumnParallelLinear, VocabParallelEmbedding, linear
from batchrun.layers.rotary import RotaryEmbedding
from batchrun.models.blocks.context import BuildContext
from batchrun.models.blocks.layer import PreNormLayer
from batchrun.models.fused_decode import FusedDecode
from batchrun.parallel.partition import ShardSpec


class ForwardBatch(NamedTuple):
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor | None  # [S] rows of T whose logits are wanted; None: all


class Rope(NamedTuple):
    """One rotary table's base and scaling (rope_type and its parameters), over `dim` dims of a
    head (0: the config's rotary_dim)."""

    theta: float
    scaling: dict
    dim: int = 0


class CausalLM(nn.Module):
    def __init__(
        self,
        ctx: BuildContext,
        layers: Sequence[PreNormLayer],
        *,
        embed_scale: bool = False,
        ropes: tuple[Rope, ...] | None = None,
        layer_ropes: tuple[int, ...] | None = None,
    ):
        """layers: the decoder layers, built from blocks by the architecture's file;
        embed_scale: the embeddings times sqrt(hidden); ropes: the rotary tables (default: the
        config's rope_theta and rope_scaling), and layer_ropes: which one each layer uses
        (default: the first)."""
        super().__init__()
        cfg, part = ctx.cfg, ctx.part
        self.config = cfg
        self.kernels = ctx.kernels
        self.tp = ctx.tp
        self.partition = part
        self.num_kv_heads = part.num_kv_heads  # per rank: what the KV pool holds
        vocab = part.vocab_spec()
        self.embed_tokens = VocabParallelEmbedding(
            vocab, part.vocab_per_rank, cfg.hidden_size, ctx.tp, ctx.dtype, ctx.device
        )
        self.layers = nn.ModuleList(layers)
        self.norm = ctx.norm()
        # tied models reuse embed_tokens, whose vocab slice is the same
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else ColumnParallelLinear(
                cfg.hidden_size,
                vocab,
                part.vocab_per_rank,
                False,
                ctx.dtype,
                ctx.device,
                ctx.kernels,
            )  # fmt: skip
        )
        self.ropes = ropes or (Rope(cfg.rope_theta, cfg.rope_scaling),)
        self.layer_ropes = layer_ropes or (0,) * len(self.layers)
        self.max_positions = ctx.max_positions
        self.rotaries: tuple[RotaryEmbedding, ...] = ()
        self.make_rotaries(ctx.device)
        # the factor rounded to the model's dtype as transformers' does (a Python float
        # multiplies in fp32 and rounds once, as its 0-dim tensor of the dtype does)
        self.embed_scale = (
            float(torch.tensor(cfg.hidden_size**0.5).to(ctx.dtype)) if embed_scale else None
        )
        # the one-row fused decode where the kernel plan turns it on (None: off)
        self.fused = FusedDecode.for_model(self)

    def make_rotaries(self, device: torch.device | str) -> None:
        """The rotary tables on `device` (a model built on the meta device makes them again
        on the real one)."""
        self.rotaries = tuple(
            RotaryEmbedding(
                rope.dim or self.config.rotary_dim,
                self.max_positions,
                rope.theta,
                rope.scaling,
                device,
                self.kernels,
            )  # fmt: skip
            for rope in self.ropes
        )

    @property
    def rotary(self) -> RotaryEmbedding:
        """The rotary of rope_theta and rope_scaling (the first table)."""
        return self.rotaries[0]

    def rotary_of(self, layer_id: int) -> RotaryEmbedding:
        return self.rotaries[self.layer_ropes[layer_id]]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings [T, hidden] of input_ids (scaled where the model scales them)."""
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale is None else x * self.embed_scale

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def kv_shapes(self) -> tuple[tuple[int, int], ...]:
        """(this rank's KV heads, head dim) of each layer that writes KV, in order: the KV
        pool's buffers."""
        cfg = self.config
        return tuple(
            (self.layers[i].self_attn.num_kv_heads, cfg.head_dim_of(i)) for i in cfg.kv_layers
        )

    def param_shards(self) -> dict[str, ShardSpec]:
        """Parameter name -> the slice of the full tensor it holds; absent: replicated."""
        specs = {}
        for prefix, module in self.named_modules():
            if module is not self and hasattr(module, "param_shards"):
                for name, spec in module.param_shards().items():
                    specs[f"{prefix}.{name}"] = spec
        return specs

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """Returns logits [S, vocab] for the rows in batch.logits_indices (all if None), in the
        model's dtype: the sampler upcasts to fp32 where it computes probabilities, and a greedy
        batch takes the argmax as they are."""
        x, residual = self.embed(batch.input_ids), None  # [T, hidden]
        if self.fused is not None and self.fused.takes(x):
            return self.fused.forward(x, batch, backend)
        for i in range(len(self.layers)):
            q, k, v, residual = self.piece(i, x, residual)
            x = self.attention(i, q, k, v, batch.positions, backend)
        x, residual = self.piece(len(self.layers), x, residual)
        return self.logits(x, residual, batch.logits_indices)

    def piece(self, i: int, x: torch.Tensor, residual: torch.Tensor | None):
        """Layer i-1's post-attention half of its attention's output x (for i == 0, x is the
        embeddings), then layer i's pre-attention half: (q, k, v, residual); past the last layer
        (i == L): (hidden, residual)."""
        if i > 0:
            x, residual = self.layers[i - 1].post_attention(x, residual)
        if i == len(self.layers):
            return x, residual
        return self.layers[i].pre_attention(x, residual)

    def attention(self, i, q, k, v, positions, backend, out=None) -> torch.Tensor:
        """Layer i's rotary and attention of (q, k, v) [T, heads, D] -> [T, H * D] (into `out`
        where given)."""
        return self.layers[i].self_attn.attend(q, k, v, positions, self.rotary_of(i), backend, out)

    def logits(self, x, residual, logits_indices: torch.Tensor | None) -> torch.Tensor:
        """The final norm and the LM head over the last layer's (hidden, residual), for the rows
        `logits_indices` (all if None)."""
        if logits_indices is not None:
            x, residual = x[logits_indices], residual[logits_indices]
        x, _ = self.norm.forward_with_residual(x, residual)
        logits = linear(x, self.lm_head_weight, kernels=self.kernels)  # [S, V / TP]
        if self.tp.is_parallel:
            # every rank gets the full logits, so all sample the same tokens
            logits = self.tp.all_gather(logits)[:, : self.config.vocab_size]
        return logits
