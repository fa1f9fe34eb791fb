"""Gemma 4's checkpoint tensors whose place depends on the layer (the spec's `experts_reader`:
models/loader.py offers it every tensor first; the rest load the common way):

    self_attn.{q,k,v}_proj   -> self_attn.qkv_proj at the layer's own head dim and KV heads; a
                                KV-shared layer's q_proj alone; an attention_k_eq_v full layer's
                                k_proj fills k's rows and v's
    mlp.{gate,up}_proj       -> mlp.gate_up_proj at the layer's width (double-wide layers)
    experts.gate_up_proj     [E, 2I, H] and experts.down_proj [E, H, I], split along I
    embed_tokens_per_layer, per_layer_model_projection, per_layer_projection_norm (E-models)

Each parameter takes its rank's slice (its ShardSpec) of the full tensor.

A quantized checkpoint (`gemma4_linears`): each layer's q/k/v/o and gate/up/down load in its
format at the layer's own shape (a KV-shared layer's q_proj and o_proj; an attention_k_eq_v
layer's k_proj decoded once for k's rows and once for v's); the experts are stacked tensors, no
linears, and stay plain; the router and the per-layer input projections are read plain only
(`refuse_quantized_extras`: a checkpoint that quantizes them is refused by name). A KV-shared
layer's k_proj / v_proj, which transformers does not run, are skipped in any format.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from batchrun.errors import ModelConfigError, WeightLoadError
from batchrun.models.quant_loader import Linears, attention_linears
from batchrun.parallel.partition import ShardSpec, replicated

if TYPE_CHECKING:
    from batchrun.models.config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")
_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.experts\.(gate_up_proj|down_proj)$")
_TOP = ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")
_SHARED_KV = re.compile(r"^model\.layers\.(\d+)\.self_attn\.[kv]_proj\.")


def gemma4_linears(cfg: ModelConfig, layer_id: int) -> Linears:
    """Layer `layer_id`'s quantizable linears (models/quant_loader.py's form) at its head dim,
    KV heads and MLP width."""
    head_dim, kv_heads = cfg.head_dim_of(layer_id), cfg.kv_heads_of(layer_id)
    attn = attention_linears(cfg, head_dim, kv_heads)
    q, kv = cfg.num_heads * head_dim, kv_heads * head_dim
    if cfg.kv_source(layer_id) != layer_id:  # q only: the KV is another layer's
        attn[0] = ("self_attn.qkv_proj", (("self_attn.q_proj", q),), cfg.hidden_size)
    elif cfg.arch_options.k_eq_v[layer_id]:  # v's rows are k_proj's
        parts = (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.k_proj", kv))
        attn[0] = ("self_attn.qkv_proj", parts, cfg.hidden_size)
    width = cfg.arch_options.mlp_widths[layer_id]
    return attn + [
        ("mlp.gate_up_proj", (("mlp.gate_proj", width), ("mlp.up_proj", width)), cfg.hidden_size),
        ("mlp.down_proj", (("mlp.down_proj", cfg.hidden_size),), width),
    ]


def refuse_quantized_extras(cfg: ModelConfig) -> None:
    """ModelConfigError naming the router or per-layer input projection that the checkpoint's
    quantization_config quantizes: batchrun reads them as plain weights."""
    scheme = cfg.quantization
    if scheme is None:
        return
    names = ["model.per_layer_model_projection"] if cfg.arch_options.per_layer_dim else []
    for i in range(cfg.num_layers):
        if cfg.moe is not None:
            names.append(f"model.layers.{i}.router.proj")
        if cfg.arch_options.per_layer_dim:
            names += [f"model.layers.{i}.per_layer_input_gate",
                      f"model.layers.{i}.per_layer_projection"]  # fmt: skip
    quantized = [n for n in names if scheme.is_quantized(n)]
    if quantized:
        raise ModelConfigError(
            f"{scheme.describe()}: the checkpoint quantizes {', '.join(quantized[:3])}"
            f"{' ...' if len(quantized) > 3 else ''}, which batchrun reads as plain weights for "
            "Gemma 4 (its q/k/v/o and gate/up/down linears load quantized); supported: "
            "checkpoints whose quantization_config leaves the router and the per-layer input "
            "projections out (its ignore list)"
        )


class Gemma4Reader:
    def __init__(
        self, params: dict[str, torch.Tensor], specs: dict[str, ShardSpec], cfg: ModelConfig
    ):
        self.params, self.specs, self.cfg = params, specs, cfg
        self.filled: dict[str, int] = {}

    def take(self, name: str, get, path: Path) -> bool:
        """Whether tensor `name` is this reader's (then loaded)."""
        top = name.removeprefix("model.").removesuffix(".weight")
        if name.startswith("model.") and top in _TOP:
            pname = top if top == "embed_tokens_per_layer" else f"{top}.weight"
            self._copy(pname, get(), 0, -1, name, path)
            return True
        m = _SHARED_KV.match(name)
        if m and self.cfg.kv_source(int(m.group(1))) != int(m.group(1)):
            return True  # a KV-shared layer's k/v tensors: transformers ignores them too
        m = _EXPERTS.match(name)
        if m:
            self._copy(f"layers.{m.group(1)}.experts.{m.group(2)}", get(), 0, -1, name, path)
            return True
        m = _LAYER.match(name)
        if not m:
            return False
        i, module = int(m.group(1)), m.group(2)
        target = self._fused(i, module)
        if target is None:
            return False
        pname, segments = target
        tensor = get()
        for start, rows in segments:
            self._copy(pname, tensor, start, rows, name, path)
        return True

    def _fused(self, i: int, module: str) -> tuple[str, list[tuple[int, int]]] | None:
        """(our fused parameter, the (row offset, rows) segments the tensor fills) of layer i's
        module; None where it is not a fused one."""
        cfg = self.cfg
        q = cfg.num_heads * cfg.head_dim_of(i)
        kv = cfg.kv_heads_of(i) * cfg.head_dim_of(i)
        attn = f"layers.{i}.self_attn.qkv_proj.weight"
        k_eq_v = cfg.arch_options.k_eq_v[i]
        if module == "self_attn.q_proj":
            return attn, [(0, q)]
        if module in ("self_attn.k_proj", "self_attn.v_proj"):  # a KV-shared layer's: take()
            if module == "self_attn.k_proj":
                return attn, [(q, kv), (q + kv, kv)] if k_eq_v else [(q, kv)]
            return attn, [(q + kv, kv)]
        width = cfg.arch_options.mlp_widths[i]
        if module == "mlp.gate_proj":
            return f"layers.{i}.mlp.gate_up_proj.weight", [(0, width)]
        if module == "mlp.up_proj":
            return f"layers.{i}.mlp.gate_up_proj.weight", [(width, width)]
        return None

    def _copy(self, pname: str, tensor: torch.Tensor, start: int, rows: int, name, path) -> None:
        """Rows [start, start + rows) of the full parameter `pname` (along its split dim) from
        `tensor` (rows -1: the whole parameter)."""
        param = self.params.get(pname)
        if param is None:
            raise WeightLoadError(
                f"{path.name}: unexpected tensor {name!r} for {self.cfg.architecture} (mapped to "
                f"{pname!r}, which this model does not have); check that config.json matches"
            )
        spec = self.specs.get(pname) or replicated(param.shape[0])
        expected = list(param.shape)
        expected[spec.dim] = spec.full_size if rows == -1 else rows
        if tuple(tensor.shape) != tuple(expected):
            raise WeightLoadError(
                f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                f"{tuple(expected)} from config.json"
            )
        rows = spec.full_size if rows == -1 else rows
        with torch.no_grad():
            for src, dst, n in spec.pieces(start, rows):
                dest = param.data.narrow(spec.dim, dst, n)
                dest.copy_(tensor.narrow(spec.dim, src, n).to(dest.dtype))
                self.filled[pname] = self.filled.get(pname, 0) + dest.numel()

    def check_complete(self) -> None:
        """The loader's own check names what is missing."""
