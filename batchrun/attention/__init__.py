"""Attention backends behind one interface (see base.py). Imported lazily by name."""

from __future__ import annotations

from batchrun.attention.base import AttentionBackend, AttentionInputs


def create_backend(name: str, kv_pool, req_to_token, device) -> AttentionBackend:
    """Build the backend called `name` (auto: the best one importable on this device)."""
    if name == "auto":
        name = "torch"  # NOTE: GPU backends (triton, flashinfer) arrive with the GPU runtime
    if name == "torch":
        from batchrun.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(kv_pool, req_to_token)
    raise ValueError(
        f"attention backend {name!r} is not available in this build; use 'torch' or 'auto'"
    )


__all__ = ["AttentionBackend", "AttentionInputs", "create_backend"]
