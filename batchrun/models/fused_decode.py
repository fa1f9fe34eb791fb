"""The one-row fused decode: a decode step of one row with every matmul on kernels/gemv.py (an FP8
layer's on kernels/fp8_gemv.py, with the same epilogues; `takes_decode_norms`), each residual add
and the norm after it inside the matmul before (o_proj, down_proj: gemv_residual), the SwiGLU
gate inside gate_up's. Its modes (KernelPlan.decode_norms):

    off        the model's forward, the norms as kernels of their own
    all        the first layer's input norm a kernel, every later norm inside the matmul before
               it; a mixture's experts take the add and the next norm in their down GEMV
               (MoE.forward_residual)
    fold-all   every input norm inside the qkv matmul after it and every post-attention norm
               inside gate_up's (gemv_rms, on copies of the weights times the norm's: folded
               weights), o_proj only adds the residual; dense bf16 models only

`resolve_mode` is the rule that picks the mode (engine/kernel_choice.py calls it): "all" up to
NORMS_IN_MATMUL_BEFORE_MAX_HIDDEN, "fold-all" above it on a dense bf16 model, else "off"; the
figures behind it are in docs/benchmarks.md, "What each feature is worth". The folded
weights are made by `prepare`, after the weights are loaded and before the KV pool takes the free
memory, only where they fit FOLD_MAX_FREE_SHARE of it: else the decode runs "off".
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from batchrun.layers.linear import (
    decode_gemv,
    decode_gemv_residual,
    takes_decode_norms,
    takes_gemv,
)
from batchrun.layers.moe import MoE, experts_take_norms
from batchrun.models.blocks.layer import SandwichNormLayer

if TYPE_CHECKING:
    from batchrun.models.config import ModelConfig

try:
    from batchrun.kernels.gemv import gemv, gemv_rms, rms_fold_weight
except ImportError:  # no Triton (CPU-only installs): KernelPlan.triton_ops is off
    gemv = gemv_rms = rms_fold_weight = None

log = logging.getLogger(__name__)

MODES = ("off", "all", "fold-all")
# the widest hidden size whose norms run inside the matmul before them ("all"); wider dense
# models fold them into the matmul after them ("fold-all")
NORMS_IN_MATMUL_BEFORE_MAX_HIDDEN = 2048
# NOTE: the folded weights are copies; they may take at most this share of the device's free
# memory after the model is loaded, the rest is the KV pool's
FOLD_MAX_FREE_SHARE = 0.25


def resolve_mode(
    requested: str,
    cfg: ModelConfig,
    *,
    tp_size: int,
    decode_gemv: str,
    quantized: bool,
    moe: str,
    moe_decode: str,
) -> str:
    """The mode a model runs for KernelPlan.decode_norms `requested` ("auto" or one of MODES);
    ValueError for a mode that cannot run. The norms inside the matmuls need every matmul whole
    and plain: a row-parallel matmul's all-reduce comes between its sums and the residual, a
    bias too, and sandwich norms sit between the matmul and the add; the weights unquantized. A
    mixture's experts take the add and the next norm in their down GEMV (kernels/moe_gemv.py),
    alone: no shared expert beside them."""
    # NOTE: a hybrid's linear layers have no qkv matmul to fold a norm into
    plain = (
        tp_size == 1
        and cfg.linear_attention is None
        and not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.sandwich_norms)
    )
    if cfg.moe is not None:
        plain = plain and experts_take_norms(cfg.moe, moe, moe_decode)
    if requested == "auto":
        if decode_gemv != "triton" or not plain or quantized:
            return "off"
        if cfg.hidden_size <= NORMS_IN_MATMUL_BEFORE_MAX_HIDDEN:
            return "all"
        return "off" if cfg.moe is not None else "fold-all"
    if requested not in MODES:
        raise ValueError(f"decode_norms {requested!r}; supported: auto, {', '.join(MODES)}")
    if requested != "off" and not (decode_gemv == "triton" and plain and not quantized):
        raise ValueError(
            f"decode_norms {requested!r} needs decode_gemv 'triton' and a model without "
            "biases at tensor parallel size 1, unquantized weights, two norms a layer (no "
            "sandwich norms), and a mixture's experts alone (no shared expert) on "
            "kernels/moe_gemv.py (moe 'triton', moe_decode 'gemv'); use 'off' or 'auto'"
        )
    if requested == "fold-all" and cfg.moe is not None:
        raise ValueError(
            "decode_norms 'fold-all' folds the post-attention norm into gate_up's weight, which "
            "a mixture of experts does not have; use 'all', 'off' or 'auto'"
        )
    return requested


def fold_budget(device: torch.device) -> float:
    """Bytes the folded weights may take on device: FOLD_MAX_FREE_SHARE of its free memory on a
    GPU, unbounded elsewhere."""
    if device.type != "cuda":
        return float("inf")
    free, _ = torch.cuda.mem_get_info(device)
    return FOLD_MAX_FREE_SHARE * free


def prepare(model) -> str:
    """Make `model`'s folded weights where its mode needs them; returns the mode its one-row
    decode runs ("off" without a fused decode)."""
    return "off" if model.fused is None else model.fused.prepare()


class FusedDecode:
    """The fused decode of one CausalLM (models/blocks/model.py), which calls `takes` and
    `forward` for each step."""

    def __init__(self, model, mode: str):
        self.model = model
        self.wanted = mode
        # "fold-all" runs as "off" until `prepare` has made its folded weights
        self.mode = "off" if mode == "fold-all" else mode
        self.qkv_rms: list[torch.Tensor] = []  # per layer: qkv weight times its input norm's
        self.gate_up_rms: list[torch.Tensor] = []  # gate_up's times its post-attention norm's

    @classmethod
    def for_model(cls, model) -> FusedDecode | None:
        """The fused decode of `model` in its kernel plan's mode (None: "off"); ValueError
        where the model's blocks cannot take it."""
        mode = model.kernels.decode_norms
        if mode not in ("all", "fold-all"):
            return None
        layers = model.layers
        if model.tp.is_parallel or any(isinstance(layer, SandwichNormLayer) for layer in layers):
            raise ValueError(
                "decode_norms other than 'off' need a model without biases at TP=1, with two "
                "norms a layer"
            )
        matmuls = [
            proj
            for layer in layers
            for proj in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                getattr(layer.mlp, "gate_up_proj", None),
                getattr(layer.mlp, "down_proj", None),
            )
            if proj is not None
        ]
        if not all(map(takes_decode_norms, matmuls)):
            raise ValueError(
                "decode_norms other than 'off' need every decode matmul on kernels/gemv.py or, "
                "for an FP8 model, kernels/fp8_gemv.py (decode_gemv 'triton') and no biases; an "
                "INT4 model runs with 'off'"
            )
        if mode == "fold-all" and any(proj.quant is not None for proj in matmuls):
            raise ValueError(
                "decode_norms 'fold-all' folds the norms' weights into bf16 matmul weights, "
                "which a quantized model does not have; use 'all' or 'off'"
            )
        experts = [layer.mlp for layer in layers if isinstance(layer.mlp, MoE)]
        if experts and (mode == "fold-all" or not all(m.takes_residual() for m in experts)):
            raise ValueError(
                "decode_norms other than 'off' on a mixture of experts need its experts alone "
                "(no shared expert, no biases) on kernels/moe_gemv.py (moe 'triton', moe_decode "
                "'gemv'), and not 'fold-all' (the experts are no one matmul to fold a norm into)"
            )
        return cls(model, mode)

    def prepare(self) -> str:
        """Make the folded weights "fold-all" needs: copies (llama-8b's gate_up alone is several
        GB), so the other paths keep theirs. Where they would take more than FOLD_MAX_FREE_SHARE
        of the device's free memory none are made and the decode runs "off". Returns the mode
        the decode runs."""
        if self.wanted != "fold-all":
            return self.mode
        layers = self.model.layers
        size = sum(
            layer.self_attn.qkv_proj.weight.nbytes + layer.mlp.gate_up_proj.weight.nbytes
            for layer in layers
        )
        budget = fold_budget(self.model.lm_head_weight.device)
        if size > budget:
            log.info(
                "fold-all's folded weights (%.1f GB) left out: over the budget of %.1f GB; "
                "the one-row decode runs 'off'", size / 1e9, budget / 1e9,
            )  # fmt: skip
            self.mode = "off"
            return self.mode
        self.qkv_rms = [
            rms_fold_weight(
                layer.self_attn.qkv_proj.weight.detach(), layer.input_layernorm.weight.detach()
            )
            for layer in layers
        ]
        self.gate_up_rms = [
            rms_fold_weight(
                layer.mlp.gate_up_proj.weight.detach(),
                layer.post_attention_layernorm.weight.detach(),
            )
            for layer in layers
        ]
        if self.model.lm_head_weight.is_cuda:
            torch.cuda.empty_cache()  # the fp32 temporaries back to the driver, whose free
            # memory sizes the KV pool
        self.mode = "fold-all"
        return self.mode

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the step of embeddings x runs here: one row, the mode on, gemv's dtypes."""
        return x.shape[0] == 1 and self.mode != "off" and takes_gemv(x, None, self.model.kernels)

    def forward(self, x: torch.Tensor, batch, backend) -> torch.Tensor:
        """Logits of a one-row decode batch; x: its embeddings [1, hidden]."""
        model, layers = self.model, self.model.layers
        fold = self.mode == "fold-all"
        if fold:  # every input norm inside its qkv matmul; the final norm a kernel
            h, normed = x, None
            next_norms = [None] * (len(layers) - 1) + [model.norm]
        else:
            h, normed = x, layers[0].input_layernorm(x)
            next_norms = [layer.input_layernorm for layer in layers[1:]] + [model.norm]
        for i, next_norm in enumerate(next_norms):
            h, normed = self._layer(i, h, normed, next_norm, batch.positions, backend, fold)
        if batch.logits_indices is not None:
            normed = normed[batch.logits_indices]
        return gemv(normed, model.lm_head_weight, pdl=model.kernels.pdl)

    def _layer(self, i, h, normed, next_norm, positions, backend, fold: bool):
        """Layer i of one row in 6 kernels instead of 8. Takes h (the residual stream) and
        normed (this layer's input norm of it; None with `fold`: it runs inside the qkv
        matmul); returns the next h and next_norm of it ("all": inside down's epilogue; `fold`:
        None, or the final norm as a kernel after the last layer)."""
        layer, pdl = self.model.layers[i], self.model.kernels.pdl
        attn, mlp, post = layer.self_attn, layer.mlp, layer.post_attention_layernorm
        if fold:
            qkv = gemv_rms(h, self.qkv_rms[i], layer.input_layernorm.eps, pdl=pdl)
        else:
            qkv = decode_gemv(attn.qkv_proj, normed)
        q, k, v = attn.split_heads(qkv)
        out = self.model.attention(i, q, k, v, positions, backend)
        if fold:
            h = decode_gemv_residual(attn.o_proj, out, h)[0]
            act = gemv_rms(h, self.gate_up_rms[i], post.eps, swiglu=True, pdl=pdl)
            h, _ = decode_gemv_residual(mlp.down_proj, act, h, None)
            return h, None if next_norm is None else next_norm(h)
        h, normed = decode_gemv_residual(attn.o_proj, out, h, (post.weight, post.eps))
        norm = (next_norm.weight, next_norm.eps)
        if isinstance(mlp, MoE):  # the router and the experts' GEMVs, the add in their down's
            return mlp.forward_residual(normed, h, norm)
        act = decode_gemv(mlp.gate_up_proj, normed, swiglu=True)
        return decode_gemv_residual(mlp.down_proj, act, h, norm)
