"""Decoder layers: an attention block and an MLP block between norms, in the residual-stream form
`h = x + attn(norm(x)); out = h + mlp(norm(h))`, taken and returned as (hidden, residual) with
out = hidden + residual, so each add fuses into the next norm (the first layer gets residual None
and x = the embeddings).

A layer is written as two halves around its attention, which runs eagerly between them (the
model's `attention`, with the layer's rotary), so that the model's forward and the piecewise CUDA
graphs (engine/piecewise_graph.py) run one definition:

    pre_attention(x, residual)      -> (q, k, v, residual)   input norm, qkv, q/k norm
    post_attention(out, residual)   -> (hidden, residual)    o_proj, norms, MLP

    PreNormLayer       a norm before the attention and one before the MLP
    SandwichNormLayer  also a norm on each block's output before its residual add, and the
                       MLP's input normed by a norm of its own (four norms a layer)
"""

from __future__ import annotations

import torch
from torch import nn

from batchrun.models.blocks.attention import Attention
from batchrun.models.blocks.context import BuildContext


class PreNormLayer(nn.Module):
    def __init__(self, ctx: BuildContext, self_attn: Attention, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = ctx.norm()
        self.self_attn = self_attn
        self.post_attention_layernorm = ctx.norm()
        self.mlp = mlp

    def input_norm(self, x: torch.Tensor, residual: torch.Tensor | None):
        """(norm(x + residual), x + residual); the first layer's residual is None (x alone)."""
        if residual is None:
            return self.input_layernorm(x), x
        return self.input_layernorm.forward_with_residual(x, residual)

    def pre_attention(self, x: torch.Tensor, residual: torch.Tensor | None):
        """(q, k, v, residual): the input norm, the qkv projection and q/k norm; q and k before
        rotary, which is the attention's."""
        x, residual = self.input_norm(x, residual)
        q, k, v = self.self_attn.project(x)
        return q, k, v, residual

    def post_attention(self, attn_out: torch.Tensor, residual: torch.Tensor):
        """(hidden, residual) from the attention's output [T, H * D]: o_proj, the norm, the MLP."""
        x = self.self_attn.o_proj(attn_out)
        x, residual = self.post_attention_layernorm.forward_with_residual(x, residual)
        return self.mlp(x), residual


class SandwichNormLayer(PreNormLayer):
    def __init__(self, ctx: BuildContext, self_attn: Attention, mlp: nn.Module):
        super().__init__(ctx, self_attn, mlp)
        self.pre_feedforward_layernorm = ctx.norm()
        self.post_feedforward_layernorm = ctx.norm()

    def post_attention(self, attn_out: torch.Tensor, residual: torch.Tensor):
        """The attention's output normed before the residual add, the MLP's input by
        pre_feedforward_layernorm and its output by post_feedforward_layernorm."""
        x = self.post_attention_layernorm(self.self_attn.o_proj(attn_out))
        x, residual = self.pre_feedforward_layernorm.forward_with_residual(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual
