"""Attention backends behind one interface (see base.py). Imported lazily by name, so that the
torch backend runs where Triton or FlashInfer is not installed. FlashInfer's FA3 prefill
(fa3_prefill.py) serves the Triton backend's extend rows; it is no backend of its own."""

from __future__ import annotations

from batchrun.attention.base import AttentionBackend, AttentionInputs
from batchrun.config import KernelPlan


def create_backend(kernels: KernelPlan, kv_pool, req_to_token) -> AttentionBackend:
    """The backend the resolved kernel plan names (engine/kernel_choice.py picks it)."""
    name = kernels.attention
    if name == "torch":
        from batchrun.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(kv_pool, req_to_token)
    if name == "triton":
        from batchrun.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(kv_pool, req_to_token, kernels)
    raise ValueError(f"attention backend {name!r} is not resolved; see engine/kernel_choice.py")


__all__ = ["AttentionBackend", "AttentionInputs", "create_backend"]
