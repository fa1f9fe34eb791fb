"""The FP8 KV cache (EngineConfig.kv_cache_dtype "fp8_e4m3"): its storage dtype, the per-layer
scales, and the quantization every writer of the pool applies.

    stored = e4m3fn(clamp(x * (1 / scale), -448, 448))      read = float(stored) * scale

One k scale and one v scale per layer (float32 scalars): the checkpoint's (ModelOpt's
`self_attn.k_proj.k_scale` / `v_proj.v_scale`, compressed-tensors' `kv_cache_scheme` with
`self_attn.k_scale` / `v_scale`; models/quant_loader.py keeps them on the attention), else 1.0.
Readers fold the scales instead of multiplying every element: k's into the softmax scale, v's
into the attention output (attention is linear in v).

NOTE: the stored value multiplies by the float32 reciprocal of the scale rather than dividing:
Triton's float32 division on the GPU is not correctly rounded, a product is, so the torch path
(`quantize_kv`) and the Triton store kernels (kernels/kv_store.py's `quantize_e4m3`) give the
same bits.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from batchrun.errors import WeightLoadError
from batchrun.quant.weights import FP8_DTYPE, FP8_MAX

log = logging.getLogger(__name__)

KV_FP8_DTYPE = FP8_DTYPE  # torch.float8_e4m3fn


def _f32(x: float) -> float:
    """x rounded to float32 (what a kernel's float argument holds)."""
    return float(torch.tensor(x, dtype=torch.float32))


@dataclass(frozen=True)
class KVScale:
    """A layer's KV scales, each a float32 value (1.0: a cache in the compute dtype)."""

    k: float = 1.0
    v: float = 1.0

    @property
    def inv_k(self) -> float:
        return _f32(1.0 / self.k)

    @property
    def inv_v(self) -> float:
        return _f32(1.0 / self.v)


def kv_storage_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type: the compute dtype ("auto") or float8_e4m3fn."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype == "fp8_e4m3":
        return KV_FP8_DTYPE
    raise ValueError(f"kv_cache_dtype must be auto or fp8_e4m3; got {kv_cache_dtype!r}")


def layer_scales(model) -> list[KVScale]:
    """Each decoder layer's KV scales as its attention keeps them from the checkpoint (1.0 where
    it has none). WeightLoadError for a scale that is not a positive finite number."""
    scales, missing = [], 0
    for i in model.config.kv_layers:  # the layers that write KV: the pool's buffers
        attn = model.layers[i].self_attn
        pair = []
        for kind in ("k", "v"):
            value = getattr(attn, f"{kind}_scale", None)
            if value is None:
                missing += 1
                value = 1.0
            elif not (math.isfinite(value) and value > 0.0):
                raise WeightLoadError(
                    f"model.layers.{i}.self_attn's {kind}_scale is {value}; an FP8 KV-cache "
                    "scale must be a positive finite number"
                )
            pair.append(_f32(value))
        scales.append(KVScale(*pair))
    if missing:
        log.warning(
            "FP8 KV cache: %d of %d layer scales are not in the checkpoint and are 1.0 (values "
            "beyond +-448 are clamped)",
            missing,
            2 * len(scales),
        )
    return scales


def quantize_kv(x: torch.Tensor, inv_scale: float) -> torch.Tensor:
    """x [..] -> float8_e4m3fn: clamp(x * inv_scale, -448, 448), rounded to nearest even."""
    return (x.float() * inv_scale).clamp(-FP8_MAX, FP8_MAX).to(KV_FP8_DTYPE)
