"""Gemma 4 (Gemma4ForCausalLM, model_type gemma4_text; Gemma4ForConditionalGeneration's text
model, model_type gemma4, whose vision and audio towers are skipped): dense, mixture of experts
and the E-models (per-layer inputs, KV shared by the last layers). The layer is
models/blocks/gemma4_layer.py; this file reads config.json and assembles the model.

What batchrun reads from the text config, and what each does:

    layer_types, sliding_window      sliding and full layers (every 6th full by default)
    head_dim, num_key_value_heads    the sliding layers'
    global_head_dim,                 the full layers' (as shipped); or per_layer_config, a dict
    num_global_key_value_heads       of layer index ("05") -> head_dim / num_key_value_heads
                                     (as transformers writes it)
    rope_parameters                  per layer type; the full layers' "proportional" rotates the
                                     first partial_rotary_factor of the frequencies
    num_kv_shared_layers             the last layers read the KV of the last earlier layer of
                                     their type and write none (the KV pool holds no buffer
                                     for them)
    attention_k_eq_v                 the full layers' v is k_proj's output (v_norm still applies)
    hidden_size_per_layer_input,     the E-models' per-layer inputs: an embedding of its own
    vocab_size_per_layer_input       plus a projection of the embeddings, one slice a layer
    use_double_wide_mlp              the KV-shared layers' MLP twice intermediate_size wide
    enable_moe_block, num_experts,   a dense MLP beside routed experts in every layer
    top_k_experts, moe_intermediate_size
    final_logit_softcapping          logits = cap * tanh(logits / cap)

and refused: use_bidirectional_attention, attention_bias, a rope type other than default on the
sliding layers or default / proportional on the full ones, a quantization_config that quantizes
the router or the per-layer input projections (models/gemma4_weights.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from batchrun.errors import ModelConfigError
from batchrun.layers.linear import linear
from batchrun.models.blocks.context import BuildContext
from batchrun.models.blocks.gemma4_layer import Gemma4Layer
from batchrun.models.blocks.model import CausalLM, ForwardBatch, Rope
from batchrun.models.config import ModelConfig
from batchrun.models.gemma4_weights import Gemma4Reader, gemma4_linears, refuse_quantized_extras
from batchrun.models.moe_config import MoeConfig
from batchrun.models.spec import COMPRESSED_TENSORS_FORMATS, ArchSpec, TensorNames

MULTIMODAL = "Gemma4ForConditionalGeneration"
# transformers' Gemma4TextConfig defaults (configuration_gemma4.py)
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "sliding_window": 512,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "global_head_dim": 512,
}
TOP_LEVEL = ("architectures", "eos_token_id", "bos_token_id", "torch_dtype", "dtype",
             "tie_word_embeddings", "quantization_config")  # fmt: skip
LAYER_TYPES = ("sliding_attention", "full_attention")
DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                       "rope_theta": 1_000_000.0},
}  # fmt: skip
ROPE_TYPES = {"sliding_attention": ("default",), "full_attention": ("default", "proportional")}


@dataclass(frozen=True)
class Gemma4Options:
    """What only Gemma 4's blocks read (ModelConfig.arch_options)."""

    per_layer_dim: int  # hidden_size_per_layer_input (0: none)
    per_layer_vocab: int  # vocab_size_per_layer_input
    mlp_widths: tuple[int, ...]  # each layer's dense MLP width
    k_eq_v: tuple[bool, ...]  # per layer: v is k_proj's output (no v_proj)
    ropes: tuple[Rope, ...]  # (sliding, full)
    softcap: float | None  # final_logit_softcapping


def prepare(
    raw: dict[str, Any], source: str, multimodal: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    if multimodal:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ModelConfigError(f"{source}: {MULTIMODAL} needs text_config, got {text!r}")
        where = f"{source} text_config"
        text = {**TEXT_DEFAULTS, **text, **{k: raw[k] for k in TOP_LEVEL if raw.get(k) is not None}}
    else:
        where, text = source, {**TEXT_DEFAULTS, **raw}
    for key in ("use_bidirectional_attention", "attention_bias"):
        if text.get(key):
            raise ModelConfigError(
                f"{where}: {key} {text[key]!r} is not supported for Gemma 4 (supported: null / "
                "false, a causal decoder without attention biases)"
            )
    num_layers = int(text["num_hidden_layers"])
    types = list(text.get("layer_types") or [
        "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)
    ])  # fmt: skip
    if len(types) != num_layers or set(types) - set(LAYER_TYPES):
        raise ModelConfigError(
            f"{where}: layer_types must list {num_layers} layers, each one of "
            f"{', '.join(LAYER_TYPES)}; got {types}"
        )
    types[-1] = "full_attention"  # transformers forces the last layer full
    head_dims, kv_heads = _layer_shapes(text, types, where)
    sources = _kv_sources(types, int(text.get("num_kv_shared_layers") or 0), where)
    window = int(text["sliding_window"])
    inter = int(text["intermediate_size"])
    double = bool(text.get("use_double_wide_mlp"))
    ropes = _ropes(text, head_dims, types, where)
    per_layer_dim = int(text.get("hidden_size_per_layer_input") or 0)
    flat = {k: v for k, v in text.items() if k not in ("rope_parameters", "rope_scaling")}
    flat["rope_theta"] = ropes[0].theta
    return flat, dict(
        sliding_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
        layer_head_dims=head_dims,
        layer_kv_heads=kv_heads,
        kv_sources=sources,
        moe=_moe(text, num_layers, where),
        whole_forward=True,
        host_table_elements=int(text["vocab_size_per_layer_input"]) * per_layer_dim * num_layers,
        arch_options=Gemma4Options(
            per_layer_dim=per_layer_dim,
            per_layer_vocab=int(text["vocab_size_per_layer_input"]),
            mlp_widths=tuple(
                2 * inter if double and sources[i] != i else inter for i in range(num_layers)
            ),
            k_eq_v=tuple(
                bool(text.get("attention_k_eq_v")) and t == "full_attention" for t in types
            ),
            ropes=ropes,
            softcap=text.get("final_logit_softcapping"),
        ),
    )


def _layer_shapes(text, types, where) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each layer's (head_dim, KV heads): per_layer_config where the file has it, else the
    full layers' global_head_dim and (attention_k_eq_v) num_global_key_value_heads."""
    head_dims = [int(text["head_dim"])] * len(types)
    kv_heads = [int(text["num_key_value_heads"])] * len(types)
    per_layer = text.get("per_layer_config")
    if per_layer is None:
        glob_kv = text.get("num_global_key_value_heads")
        per_layer = {
            i: {"head_dim": text["global_head_dim"]}
            | ({"num_key_value_heads": glob_kv} if glob_kv and text.get("attention_k_eq_v", True)
               else {})
            for i, t in enumerate(types) if t == "full_attention"
        }  # fmt: skip
    for key, over in per_layer.items():
        i = int(key)
        if not 0 <= i < len(types) or set(over) - {"head_dim", "num_key_value_heads"}:
            raise ModelConfigError(
                f"{where}: per_layer_config[{key!r}] {over!r}: batchrun reads a layer index "
                f"below {len(types)} with head_dim and num_key_value_heads"
            )
        head_dims[i] = int(over.get("head_dim", head_dims[i]))
        kv_heads[i] = int(over.get("num_key_value_heads", kv_heads[i]))
    return tuple(head_dims), tuple(kv_heads)


def _kv_sources(types: list[str], num_shared: int, where: str) -> tuple[int, ...]:
    """Each layer's KV source: itself, or for the last num_shared layers the last earlier layer
    of its type (transformers' kv_sharing_modes)."""
    first = len(types) - num_shared
    if num_shared and not 0 < first:
        raise ModelConfigError(
            f"{where}: num_kv_shared_layers {num_shared} leaves no layer writing KV"
        )
    sources = list(range(len(types)))
    for i in range(first, len(types)):
        owners = [j for j in range(first) if types[j] == types[i]]
        if not owners:
            raise ModelConfigError(
                f"{where}: num_kv_shared_layers {num_shared}: layer {i} ({types[i]}) has no "
                "earlier layer of its type to read KV from"
            )
        sources[i] = owners[-1]
    return tuple(sources)


def _ropes(text, head_dims, types, where) -> tuple[Rope, Rope]:
    params = text.get("rope_parameters") or DEFAULT_ROPE
    out = []
    for kind in LAYER_TYPES:
        rope = dict(DEFAULT_ROPE[kind] if kind not in params else params[kind])
        rope_type = rope.get("rope_type", "default")
        if rope_type not in ROPE_TYPES[kind]:
            raise ModelConfigError(
                f"{where}: rope_parameters.{kind} rope_type {rope_type!r} is not supported "
                f"(supported: {', '.join(ROPE_TYPES[kind])})"
            )
        dims = [d for d, t in zip(head_dims, types) if t == kind]
        dim = dims[0] if dims else head_dims[0]
        if rope_type == "default" and rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ModelConfigError(f"{where}: {kind} default rope with partial_rotary_factor")
        theta = float(rope.pop("rope_theta"))
        out.append(Rope(theta, rope, dim))
    return out[0], out[1]


def _moe(text, num_layers: int, where: str) -> MoeConfig | None:
    if not text.get("enable_moe_block"):
        return None
    missing = [k for k in ("num_experts", "top_k_experts", "moe_intermediate_size")
               if not text.get(k)]  # fmt: skip
    if missing:
        raise ModelConfigError(f"{where}: enable_moe_block needs {', '.join(missing)}")
    return MoeConfig(
        num_experts=int(text["num_experts"]),
        top_k=int(text["top_k_experts"]),
        intermediate_size=int(text["moe_intermediate_size"]),
        norm_topk_prob=True,
        layers=tuple(range(num_layers)),
        act="gelu_pytorch_tanh",
    )


class Gemma4LM(CausalLM):
    """CausalLM with the per-layer inputs and final logit softcapping; each layer returns its
    whole output (no residual carried). With KernelPlan.per_layer_table "host" the per-layer
    embedding table lives in pinned host memory, its rows gathered by the GPU
    (kernels/host_gather.py; the ids stay on the GPU)."""

    def __init__(self, ctx: BuildContext, layers, opts: Gemma4Options, **kw):
        super().__init__(ctx, layers, **kw)
        cfg, self.opts = ctx.cfg, opts
        self.host_table = bool(opts.per_layer_dim) and ctx.kernels.per_layer_table == "host"
        if self.host_table:  # Triton: imported on CUDA only
            from batchrun.kernels.host_gather import gather_rows

            self._gather_rows = gather_rows
        self.fused = None  # the one-row fused decode takes pre-norm layers only
        dim, width = opts.per_layer_dim, opts.per_layer_dim * cfg.num_layers
        if dim:
            kw = dict(dtype=ctx.dtype, device=ctx.device)
            self.embed_tokens_per_layer = nn.Parameter(
                torch.empty(opts.per_layer_vocab, width, **kw)
            )
            self.per_layer_model_projection = nn.Linear(cfg.hidden_size, width, bias=False, **kw)
            self.per_layer_projection_norm = ctx.norm(dim)
            self.per_layer_scale = float(torch.tensor(dim**0.5).to(ctx.dtype))

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """[T, L, P]: (norm(projection of the embeddings) + per-layer embedding) / sqrt(2)."""
        if not self.opts.per_layer_dim:
            return None
        shape = (x.shape[0], self.config.num_layers, self.opts.per_layer_dim)
        if self.host_table:
            own = self._gather_rows(self.embed_tokens_per_layer, input_ids, self.per_layer_scale)
        else:
            own = self.embed_tokens_per_layer[input_ids] * self.per_layer_scale
        own = own.view(shape)
        proj = self.per_layer_model_projection(x) * self.config.hidden_size**-0.5
        return (self.per_layer_projection_norm(proj.view(shape)) + own) * 2.0**-0.5

    def to_empty(self, *, device, recurse: bool = True):
        """nn.Module's, with a host table allocated in pinned host memory, never on `device`."""
        table = self._parameters.pop("embed_tokens_per_layer") if self.host_table else None
        super().to_empty(device=device, recurse=recurse)
        if table is not None:
            host = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
            self.embed_tokens_per_layer = nn.Parameter(host, requires_grad=False)
        return self

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, backend) -> torch.Tensor:
        x = self.embed(batch.input_ids)  # [T, hidden]
        per_layer = self.per_layer_inputs(batch.input_ids, x)
        for i, layer in enumerate(self.layers):
            q, k, v, residual = layer.pre_attention(x, None)
            out = self.attention(i, q, k, v, batch.positions, backend)
            x, _ = layer.post_attention(
                out, residual, None if per_layer is None else per_layer[:, i]
            )
        return self.logits(x, None, batch.logits_indices)

    def piece(self, i, x, residual):
        raise ValueError("Gemma 4 runs no piecewise graphs (its per-layer inputs)")

    def logits(self, x, residual, logits_indices) -> torch.Tensor:
        if logits_indices is not None:
            x = x[logits_indices]
        logits = linear(self.norm(x), self.lm_head_weight, kernels=self.kernels)  # [S, V / TP]
        if self.tp.is_parallel:
            logits = self.tp.all_gather(logits)[:, : self.config.vocab_size]
        cap = self.opts.softcap
        return logits if not cap else torch.tanh(logits / cap) * cap


def build(cfg: ModelConfig, ctx: BuildContext) -> Gemma4LM:
    opts: Gemma4Options = cfg.arch_options
    refuse_quantized_extras(cfg)
    layers = [
        Gemma4Layer(ctx, i, opts.mlp_widths[i], opts.per_layer_dim) for i in range(cfg.num_layers)
    ]
    layer_ropes = tuple(1 if cfg.window(i) == 0 else 0 for i in range(cfg.num_layers))
    return Gemma4LM(ctx, layers, opts, embed_scale=True, ropes=opts.ropes, layer_ropes=layer_ropes)


# the conditional-generation checkpoint's text model (transformers 5's names); its vision and
# audio towers and their embedders are not run
TEXT_MODEL = TensorNames(
    renames=(("model.language_model.", "model."),),
    skipped=("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
             "model.embed_audio."),
)  # fmt: skip
_COMMON = dict(family="Gemma 4", build=build, qk_norm=True, act_field="hidden_activation",
               activations=("gelu_pytorch_tanh",), experts_reader=Gemma4Reader,
               layer_linears=gemma4_linears,
               quant_formats=COMPRESSED_TENSORS_FORMATS)  # fmt: skip
SPEC = ArchSpec(name="Gemma4ForCausalLM", model_type="gemma4_text", prepare=prepare, **_COMMON)
MULTIMODAL_SPEC = ArchSpec(name=MULTIMODAL, model_type="gemma4", names=TEXT_MODEL,
                           prepare=partial(prepare, multimodal=True), **_COMMON)  # fmt: skip
