"""Attention backends behind one interface (see base.py). Imported lazily by name."""

from __future__ import annotations

import torch

from batchrun.attention.base import AttentionBackend, AttentionInputs


def create_backend(name: str, kv_pool, req_to_token, device) -> AttentionBackend:
    """Build the backend called `name` (auto: the best one importable on this device)."""
    if name == "auto":
        name = "triton" if _triton_usable(device) else "torch"
    if name == "torch":
        from batchrun.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(kv_pool, req_to_token)
    if name == "triton":
        from batchrun.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(kv_pool, req_to_token)
    raise ValueError(
        f"attention backend {name!r} is not available in this build; "
        "use 'torch', 'triton' or 'auto'"
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
