"""The KV cache bytes `batchrun plan` quotes, for the element the run would store."""

from __future__ import annotations

from typing import NamedTuple

from batchrun.engine.window_pool import FREE_STRIDE
from batchrun.models.config import ModelConfig
from batchrun.models.context import KV_ELEMENT_BYTES, kv_bytes_per_token


class KVElement(NamedTuple):
    """A KV cache element as the run would store it: its bytes and what decides them."""

    num_bytes: int
    kind: str  # "fp8_e4m3", or the compute dtype's name ("float32 (--dtype auto on the CPU)")

    @classmethod
    def of(cls, kv_cache_dtype: str, dtype: str, device: str) -> KVElement:
        """--kv-cache-dtype's element, or ("auto") the compute dtype's, which --dtype and
        --device resolve as the engine does: float32 on the CPU, bfloat16 on CUDA."""
        if kv_cache_dtype != "auto":
            return cls(KV_ELEMENT_BYTES[kv_cache_dtype], kv_cache_dtype)
        if dtype != "auto":
            return cls(4 if dtype == "float32" else 2, dtype)
        on_cpu = device == "cpu"
        if device == "auto":
            import torch  # local: plan loads it with transformers anyway

            on_cpu = not torch.cuda.is_available()
        if on_cpu:
            return cls(4, "float32 (--dtype auto on the CPU)")
        return cls(2, "bfloat16 (--dtype auto on CUDA)")

    def bytes_per_token(self, cfg: ModelConfig) -> int:
        # kv_bytes_per_token's "auto" counts 16-bit elements
        return kv_bytes_per_token(cfg, "auto") // KV_ELEMENT_BYTES["auto"] * self.num_bytes


def kv_bytes_line(cfg: ModelConfig, kv: KVElement, longest: int, peak: int) -> str:
    """The KV cache bytes of the longest request and of the longest --max-running at once."""
    per_token = kv.bytes_per_token(cfg)
    return (
        f"KV bytes     {gb(longest * per_token)} for the longest request, {gb(peak * per_token)}"
        f" for those at once ({per_token:,} bytes a token, {kv.kind} KV; the pool holds "
        f"--kv-budget tokens or --gpu-memory-utilization of the GPU memory after the weights)"
    )


def window_bytes_line(
    cfg: ModelConfig, kv: KVElement, longest: int, peak: int, max_running: int
) -> str:
    """The sliding layers keep only their window (engine/window_pool.py): the full layers' bytes
    of the longest request and of those at once, plus the windows."""
    window = max(cfg.window(i) for i in cfg.kv_layers)
    per_kind = [0, 0]  # [full, sliding] elements a token
    for i in cfg.kv_layers:
        per_kind[cfg.window(i) > 0] += cfg.kv_heads_of(i) * cfg.head_dim_of(i)
    full, sliding = (2 * n * kv.num_bytes for n in per_kind)
    span = window + FREE_STRIDE
    return (
        f"windows      the sliding layers keep their {window}-token window: "
        f"{gb(longest * full + span * sliding)} for the longest request, "
        f"{gb(peak * full + max_running * span * sliding)} for those at once ({full:,} bytes a "
        f"token for the full layers, {gb(span * sliding)} a request's window)"
    )


def gb(n: int) -> str:
    """Bytes for a report line: GB from 0.1 GB, else MB."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"
