"""gpt-oss's expert tensors, stacked in the checkpoint, read into layers/moe.py's weights:

    mlp.experts.gate_up_proj         [E, H, 2I]  gate and up interleaved (gate the even columns)
    mlp.experts.gate_up_proj_blocks  [E, 2I, H / 32, 16] uint8 + _scales [E, 2I, H / 32] (MXFP4)
    mlp.experts.gate_up_proj_bias    [E, 2I]     interleaved too
        -> mlp.w13 [E, 2I, H] and mlp.b13 [E, 2I], each expert's gate rows then its up rows
    mlp.experts.down_proj            [E, I, H]
    mlp.experts.down_proj_blocks     [E, H, I / 32, 16] + _scales [E, H, I / 32] (MXFP4)
        -> mlp.w2 [E, H, I]
    mlp.experts.down_proj_bias       [E, H]      -> mlp.b2
    mlp.router.{weight,bias}         -> mlp.gate.{weight,bias} (models/loader.py)

MXFP4 (the OCP microscaling format): each byte holds two FP4 (e2m1) values, the low nibble
first; each block of 32 values shares one power-of-two scale, an e8m0 byte (exponent + 127).
The experts are dequantized at load, one expert at a time on the model's device, to its dtype
(every FP4 value times a power of two is exact in bf16), as transformers'
convert_moe_packed_tensors does; a rank keeps its slice of each expert's width.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from batchrun.errors import WeightLoadError
from batchrun.models.config import ModelConfig
from batchrun.parallel.partition import ShardSpec

_EXPERTS = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_blocks|_scales|_bias|)$"
)
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def mxfp4_dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[..., G * 32] values of MXFP4 blocks [..., G, 16] (uint8, two values a byte, the low
    nibble first) and scales [..., G] (uint8 e8m0: 2 ** (s - 127))."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
            "(blocks [..., G, 16], scales [..., G])"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    values = values.flatten(-2)  # [..., G, 32]
    exponent = scales.to(torch.int32) - 127
    out = torch.ldexp(values, exponent[..., None])
    return out.flatten(-2).to(dtype)


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gate (the even indices) then up (the odd ones) along dim."""
    n = t.shape[dim]
    even = torch.arange(0, n, 2, device=t.device)
    return torch.cat([t.index_select(dim, even), t.index_select(dim, even + 1)], dim=dim)


class GptOssExperts:
    """Reads a gpt-oss checkpoint's expert tensors as `_load_plain` meets them (an MXFP4
    weight's blocks and scales may lie in two files: the first one met waits for the other)."""

    def __init__(self, params: dict, specs: dict[str, ShardSpec], cfg: ModelConfig):
        self.params, self.specs, self.cfg = params, specs, cfg
        self.filled: dict[str, int] = {}
        self._waiting: dict[str, tuple[str, torch.Tensor]] = {}  # name -> (kind, tensor)

    def take(self, name: str, get, path: Path) -> bool:
        """Whether `name` is an expert tensor (read here through get(): its tensor)."""
        m = _EXPERTS.match(name)
        if m is None:
            return False
        layer, proj, kind = m.group(1), m.group(2), m.group(3)
        prefix = f"layers.{layer}.mlp."
        if kind == "_bias":
            self._bias(prefix + ("b13" if proj == "gate_up_proj" else "b2"), get(), path, name)
            return True
        param = prefix + ("w13" if proj == "gate_up_proj" else "w2")
        if kind == "":
            self._plain(param, get(), path, name)
            return True
        key = f"model.layers.{layer}.mlp.experts.{proj}"
        other = self._waiting.pop(key, None)
        if other is None:
            self._waiting[key] = (kind, get())
            return True
        blocks, scales = (get(), other[1]) if kind == "_blocks" else (other[1], get())
        self._mxfp4(param, blocks, scales, path, key)
        return True

    def check_complete(self) -> None:
        if self._waiting:
            name, (kind, _) = next(iter(self._waiting.items()))
            missing = "_scales" if kind == "_blocks" else "_blocks"
            raise WeightLoadError(
                f"checkpoint has {name}{kind} but not {name}{missing}: an MXFP4 weight needs both"
            )

    def _target(self, param: str, path: Path, name: str) -> torch.Tensor:
        if param not in self.params:
            raise WeightLoadError(
                f"{path.name}: unexpected tensor {name!r} (layer beyond num_hidden_layers?); "
                "check that config.json matches the weights"
            )
        return self.params[param].data

    def _check(self, name: str, path: Path, shape, expected) -> None:
        if tuple(shape) != tuple(expected):
            raise WeightLoadError(
                f"{path.name}: tensor {name!r} has shape {tuple(shape)}, expected "
                f"{tuple(expected)} from config.json"
            )

    def _plain(self, param: str, t: torch.Tensor, path: Path, name: str) -> None:
        dest = self._target(param, path, name)
        e, h, i = dest.shape[0], self.cfg.hidden_size, self.cfg.moe.intermediate_size
        self._check(name, path, t.shape, (e, h, 2 * i) if param.endswith("w13") else (e, i, h))
        for x in range(e):  # stored [in, out]: the transpose is the weight
            self._expert(param, x, t[x].t())

    def _mxfp4(self, param: str, blocks, scales, path: Path, name: str) -> None:
        dest = self._target(param, path, name)
        e, h, i = dest.shape[0], self.cfg.hidden_size, self.cfg.moe.intermediate_size
        rows, cols = (2 * i, h) if param.endswith("w13") else (h, i)
        if cols % 32:
            raise WeightLoadError(f"{path.name}: {name}: {cols} columns is no whole MXFP4 block")
        self._check(name + "_blocks", path, blocks.shape, (e, rows, cols // 32, 16))
        self._check(name + "_scales", path, scales.shape, (e, rows, cols // 32))
        for x in range(e):  # on the parameter's device (a GPU dequantizes in milliseconds)
            b, sc = blocks[x].to(dest.device), scales[x].to(dest.device)
            self._expert(param, x, mxfp4_dequantize(b, sc, dest.dtype))

    def _expert(self, param: str, x: int, full: torch.Tensor) -> None:
        """Expert x's full weight ([2I, H] interleaved, or [H, I]) into this rank's slice."""
        dest, spec = self.params[param].data[x], self.specs[param]
        dim = 0 if param.endswith("w13") else 1  # w13: rows of [gate | up]; w2: columns
        if dim == 0:
            full = _deinterleave(full, 0)
        for s, d, n in spec.pieces(0, spec.full_size):
            out = dest.narrow(dim, d, n)
            out.copy_(full.narrow(dim, s, n).to(out.dtype))
            self.filled[param] = self.filled.get(param, 0) + out.numel()

    def _bias(self, param: str, t: torch.Tensor, path: Path, name: str) -> None:
        dest = self._target(param, path, name)
        e, h, i = dest.shape[0], self.cfg.hidden_size, self.cfg.moe.intermediate_size
        if param.endswith("b2"):
            self._check(name, path, t.shape, (e, h))
            dest.copy_(t.to(dest.dtype))
            self.filled[param] = self.filled.get(param, 0) + dest.numel()
            return
        self._check(name, path, t.shape, (e, 2 * i))
        full, spec = _deinterleave(t, 1), self.specs[param]
        for s, d, n in spec.pieces(0, spec.full_size):
            out = dest.narrow(1, d, n)
            out.copy_(full[:, s : s + n].to(dest.dtype))
            self.filled[param] = self.filled.get(param, 0) + out.numel()
