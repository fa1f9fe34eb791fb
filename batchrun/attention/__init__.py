"""Attention backends behind one interface (see base.py). Imported lazily by name."""

from __future__ import annotations

import torch

from batchrun.attention.base import AttentionBackend, AttentionInputs


def create_backend(name: str, kv_pool, req_to_token, device) -> AttentionBackend:
    """Build the backend called `name` (auto: the best one importable on this device)."""
    if name == "auto":
        # NOTE: auto stays on triton on CUDA, flashinfer included only by name: it has not been
        # measured against triton yet (scripts/bench_throughput.py --variants ...,flashinfer);
        # the lead decides whether auto prefers it where importable
        name = "triton" if _triton_usable(device) else "torch"
    if name == "torch":
        from batchrun.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(kv_pool, req_to_token)
    if name == "triton":
        from batchrun.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(kv_pool, req_to_token)
    if name == "flashinfer":
        from batchrun.attention.flashinfer_backend import (
            FlashInferAttentionBackend,
            unavailable_reason,
        )

        reason = unavailable_reason(device)
        if reason is not None:
            raise ValueError(f"attention backend 'flashinfer' cannot run here: {reason}")
        return FlashInferAttentionBackend(kv_pool, req_to_token)
    raise ValueError(
        f"unknown attention backend {name!r}; use 'torch', 'triton', 'flashinfer' or 'auto'"
    )


def _triton_usable(device) -> bool:
    if torch.device(device).type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["AttentionBackend", "AttentionInputs", "create_backend"]
