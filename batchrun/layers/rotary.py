"""Rotary position embedding (neox, rotate-half) with default, linear and llama3 scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from batchrun.config import KernelConfig

try:
    from batchrun.kernels.fused_rotary import apply_rotary_
except ImportError:  # no Triton (CPU-only installs): KernelConfig.triton_ops is off
    apply_rotary_ = None


def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, with llama3 / linear scaling applied."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a cos/sin table indexed by position."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict,
        device,
        kernels: KernelConfig | None = None,
    ):
        super().__init__()
        self.kernels = kernels or KernelConfig.reference()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.register_buffer("cos_cache", emb.cos().to(device), persistent=False)
        self.register_buffer("sin_cache", emb.sin().to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (q, k). With the Triton kernels one kernel rotates q and k in place (strided
        views allowed) and returns them; else new tensors.
        """
        # q: [T, H, D], k: [T, KV, D], positions: [T]
        if self.kernels.triton_ops:
            apply_rotary_(q, k, positions, self.cos_cache, self.sin_cache, pdl=self.kernels.pdl)
            return q, k
        cos = self.cos_cache[positions].unsqueeze(1)  # [T, 1, D] fp32
        sin = self.sin_cache[positions].unsqueeze(1)
        return _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    # NOTE: HF multiplies in the activation dtype with cos/sin cast to it; do the same.
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)
