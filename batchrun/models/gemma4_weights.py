"""Gemma 4's checkpoint tensors whose place depends on the layer (the spec's `experts_reader`:
models/loader.py offers it every tensor first; the rest load the common way):

    self_attn.{q,k,v}_proj   -> self_attn.qkv_proj at the layer's own head dim and KV heads; a
                                KV-shared layer's q_proj alone; an attention_k_eq_v full layer's
                                k_proj fills k's rows and v's
    mlp.{gate,up}_proj       -> mlp.gate_up_proj at the layer's width (double-wide layers)
    experts.gate_up_proj     [E, 2I, H] and experts.down_proj [E, H, I], split along I
    embed_tokens_per_layer, per_layer_model_projection, per_layer_projection_norm (E-models)

Each parameter takes its rank's slice (its ShardSpec) of the full tensor.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from batchrun.errors import WeightLoadError
from batchrun.parallel.partition import ShardSpec, replicated

if TYPE_CHECKING:
    from batchrun.models.config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")
_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.experts\.(gate_up_proj|down_proj)$")
_TOP = ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")


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
        if not segments:
            return True  # a KV-shared layer's k/v tensors: transformers ignores them too
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
        shares = cfg.kv_source(i) != i
        k_eq_v = cfg.arch_options.k_eq_v[i]
        if module == "self_attn.q_proj":
            return attn, [(0, q)]
        if module in ("self_attn.k_proj", "self_attn.v_proj"):
            if shares:
                return attn, []
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
