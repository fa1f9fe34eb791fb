"""The quantized linears of a model: each checkpoint linear decoded (batchrun/quant/formats) into
the unpacked layout, this rank's part sliced, the fused parts concatenated, and the result handed
to the layer, which makes what its device runs (batchrun/quant/linear.py).

    checkpoint linears                    our layer (rows of this rank, TP=2 rank 0 shown)
    q_proj [q, h] | k_proj | v_proj   ->  qkv_proj      narrow_out per part, cat_out
    o_proj [h, q]                     ->  o_proj        narrow_in (row-parallel columns)
    gate_proj | up_proj [i, h]        ->  gate_up_proj  narrow_out per part, cat_out
    down_proj [h, i]                  ->  down_proj     narrow_in
    experts.{e}.{gate,up,down}_proj   ->  mlp.w13, w2   dequantized (models/moe_weights.py)

A source gives one checkpoint linear at full (TP=1) size: `checkpoint_source` reads and decodes
its tensors (whatever shard files they sit in), `dummy_source` draws a random one, seeded by its
name, so every rank and every TP size gets the same weights.
"""

from __future__ import annotations

import logging
import re
import zlib
from collections.abc import Callable, Iterator

import torch

from batchrun.errors import WeightLoadError
from batchrun.models.checkpoint import Checkpoint
from batchrun.models.config import ModelConfig
from batchrun.models.moe_weights import quantized_experts
from batchrun.quant.weights import QuantizedWeight

log = logging.getLogger(__name__)

# (name, full rows, full columns) of a checkpoint linear -> its decoded weight
Source = Callable[[str, int, int], QuantizedWeight]

# the attention's FP8 KV-cache scales, as the formats name them: self_attn.k_scale (compressed-
# tensors), self_attn.k_proj.k_scale (ModelOpt), k_proj.output_scale (AutoFP8), kv_scale (both)
KV_SCALE = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\.(?:([kqv])_proj\.)?(k_scale|v_scale|kv_scale|output_scale)$"
)


Linears = list[tuple[str, tuple[tuple[str, int], ...], int]]


def layer_linears(cfg: ModelConfig, layer_id: int) -> Linears:
    """(our linear under decoder layer `layer_id`, its checkpoint linears with their rows, in
    order, and their input columns), all at full size: the spec's `layer_linears` where it has
    one, else attention_linears + mlp_linears."""
    own = cfg.spec.layer_linears
    if own is not None:
        return own(cfg, layer_id)
    return attention_linears(cfg) + mlp_linears(cfg, layer_id)


def attention_linears(
    cfg: ModelConfig, head_dim: int | None = None, kv_heads: int | None = None
) -> Linears:
    """Attention's qkv_proj and o_proj at `head_dim` and `kv_heads` (the config's by default);
    q_proj's rows doubled where the attention has an output gate ([query | gate] per head)."""
    head_dim = cfg.head_dim if head_dim is None else head_dim
    kv_heads = cfg.num_kv_heads if kv_heads is None else kv_heads
    q, kv, hidden = cfg.num_heads * head_dim, kv_heads * head_dim, cfg.hidden_size
    q_rows = 2 * q if cfg.attn_output_gate else q
    return [
        (
            "self_attn.qkv_proj",
            (("self_attn.q_proj", q_rows), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)),
            hidden,
        ),
        ("self_attn.o_proj", (("self_attn.o_proj", hidden),), q),
    ]


def mlp_linears(cfg: ModelConfig, layer_id: int, width: int | None = None) -> Linears:
    """The dense MLP's gate_up_proj and down_proj (of `width`, intermediate_size by default). A
    mixture of experts' MoE layer has no dense MLP: its experts are models/moe_weights.py's,
    its shared expert (if any) is a dense MLP under mlp.shared_expert."""
    inter, hidden = cfg.intermediate_size if width is None else width, cfg.hidden_size
    mlp = "mlp"
    moe = cfg.moe
    if moe is not None and moe.is_moe_layer(layer_id):
        inter = moe.shared_expert_intermediate_size
        if not inter:
            return []
        mlp = "mlp.shared_expert"
    return [
        (f"{mlp}.gate_up_proj", ((f"{mlp}.gate_proj", inter), (f"{mlp}.up_proj", inter)), hidden),
        (f"{mlp}.down_proj", ((f"{mlp}.down_proj", hidden),), inter),
    ]


def quantized_linears(model) -> Iterator[tuple[int, object, tuple[tuple[str, int], ...], int]]:
    """(layer index, our quantized linear, its checkpoint linears, input columns); none for a
    model with plain weights. A mixture's experts are not among them (quantized_experts)."""
    if model.config.quantization is None:
        return
    for i, layer in enumerate(model.layers):
        for path, parts, in_features in layer_linears(model.config, i):
            module = layer.get_submodule(path)
            if module.quant is not None:
                yield i, module, parts, in_features


def claimed_modules(model) -> set[str]:
    """The checkpoint linears the quantized layers and experts read (their tensors but the
    bias)."""
    linears = {
        f"model.layers.{i}.{suffix}"
        for i, _, parts, _ in quantized_linears(model)
        for suffix, _ in parts
    }
    return linears | {where for where, _, _, _ in quantized_experts(model.config)}


def load_quantized(model, source: Source) -> None:
    """Fill every quantized linear of `model` from `source`."""
    for i, module, parts, in_features in quantized_linears(model):
        spec, local, seg = module.spec, [], 0
        for suffix, rows in parts:
            where = f"model.layers.{i}.{suffix}"
            qw = source(where, rows, in_features)
            try:
                if spec.dim == 0:  # column-parallel: this rank's rows of the part
                    for off, dst, n in spec.pieces(seg, rows):
                        local.append((dst, qw.narrow_out(off, n)))
                else:  # row-parallel: this rank's input columns
                    for off, dst, n in spec.pieces(0, spec.full_size):
                        local.append((dst, qw.narrow_in(off, n)))
            except ValueError as e:
                raise WeightLoadError(f"{where}: {e}") from None
            seg += rows
        local.sort(key=lambda piece: piece[0])
        pieces = [p for _, p in local]
        try:
            qw = pieces[0] if len(pieces) == 1 else type(pieces[0]).cat_out(pieces)
        except ValueError as e:
            raise WeightLoadError(f"model.layers.{i} ({module.quant.spec.describe}): {e}") from None
        module.load_quantized(qw, f"model.layers.{i}")


def checkpoint_source(ckpt: Checkpoint, scheme, device: torch.device) -> Source:
    """Decodes a linear's tensors, moved to `device` first (the formats' unpacking and
    --quantization's rounding run there)."""

    def source(where: str, out_features: int, in_features: int) -> QuantizedWeight:
        tensors = {}
        for suffix in scheme.tensor_names:
            name = f"{where}.{suffix}"
            if name not in ckpt:
                raise WeightLoadError(
                    f"{ckpt.model_dir}: the checkpoint lacks {name}, which {scheme.describe()} "
                    f"needs ({', '.join(scheme.tensor_names)} for every quantized linear)"
                )
            tensors[suffix] = ckpt.get(name).to(device)
        for suffix in scheme.optional_names:
            if f"{where}.{suffix}" in ckpt:
                tensors[suffix] = ckpt.get(f"{where}.{suffix}").to(device)
        return scheme.decode(tensors, out_features, in_features, where)

    return source


def dummy_source(scheme, device: torch.device, seed: int) -> Source:
    def source(where: str, out_features: int, in_features: int) -> QuantizedWeight:
        gen = torch.Generator(device=device).manual_seed(seed + zlib.crc32(where.encode()))
        return scheme.dummy(out_features, in_features, gen)

    return source


def load_kv_scale(model, name: str, get: Callable[[str], torch.Tensor]) -> bool:
    """Keep a checkpoint's FP8 KV-cache scale (KV_SCALE) on its attention (`get` reads it);
    False when `name` is none."""
    m = KV_SCALE.match(name)
    if m is None:
        return False
    tensor = get(name)
    layer, proj, kind = int(m.group(1)), m.group(2), m.group(3)
    if layer >= len(model.layers):
        return False  # the loader reports it: not a tensor of this model
    if kind == "output_scale":  # AutoFP8: k_proj's / v_proj's output scale
        if proj not in ("k", "v"):
            return True
        kind = f"{proj}_scale"
    if tensor.numel() != 1:
        raise WeightLoadError(
            f"{name} has shape {tuple(tensor.shape)}; a KV-cache scale is one value per layer"
        )
    attn = model.layers[layer].self_attn
    value = float(tensor.float().reshape(()))
    if kind in ("k_scale", "kv_scale"):
        attn.k_scale = value
    if kind in ("v_scale", "kv_scale"):
        attn.v_scale = value
    return True
