"""Rotary position embedding (neox, rotate-half) with default, linear, llama3, LongRoPE and YaRN
scaling, over the whole head or its first `rotary_dim` dims (partial rotary), the rest passing
through.

LongRoPE: transformers picks the short factors while a sequence is at most
original_max_position_embeddings long and the long ones past it, and when a sequence grows past
that length it drops its KV cache and computes every position again with the long factors.
batchrun picks one set for the whole run, from the context it serves (max_positions, the
engine's context_len): the short factors when no request can be longer than
original_max_position_embeddings, else the long ones for every request, short ones included.
A request that crosses that length thus keeps one set of factors from its first token to its
last, and its KV never mixes the two (keys rotated with short factors attended by queries
rotated with long ones, what a per-token or per-step choice gives). The cos/sin tables stay one
static pair, which CUDA graphs, the fused kernels and the prefix cache (whose KV any request may
reuse) need. The cost: with a context beyond original_max_position_embeddings a short request
runs with the long factors, where transformers uses the short ones; an engine whose context_len
is at most original_max_position_embeddings gives transformers' tokens for every request. This
is vLLM's choice too (by its max_model_len)."""

from __future__ import annotations

import math

import torch
from torch import nn

from batchrun.config import KernelPlan

try:
    from batchrun.kernels.fused_rotary import apply_rotary_
except ImportError:  # no Triton (CPU-only installs): KernelPlan.triton_ops is off
    apply_rotary_ = None


def uses_long_factors(scaling: dict, max_positions: int) -> bool:
    """Whether a LongRoPE model serving contexts of max_positions takes the long factors."""
    return max_positions > int(scaling["original_max_position_embeddings"])


def rope_inv_freq(
    rotary_dim: int, theta: float, scaling: dict, max_positions: int = 0
) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] in fp32, with llama3 / linear / LongRoPE / YaRN
    scaling applied (LongRoPE's factors picked by max_positions: the module docstring)."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (theta**exponent)
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "longrope":
        key = "long_factor" if uses_long_factors(scaling, max_positions) else "short_factor"
        ext = torch.tensor(scaling[key], dtype=torch.float32)
        # NOTE: 1 / (ext * theta**exponent), transformers' order of operations (same bits)
        inv_freq = 1.0 / (ext * theta**exponent)
    elif rope_type == "yarn":
        inv_freq = _yarn_inv_freq(rotary_dim, theta, scaling)
    elif rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "proportional":
        # Gemma 4's full layers: the first partial_rotary_factor of the frequencies over the
        # whole head, the rest 0 (those dims pass through), all divided by factor
        angles = int(float(scaling.get("partial_rotary_factor", 1.0)) * rotary_dim // 2)
        inv_freq[angles:] = 0.0
        inv_freq = inv_freq / float(scaling.get("factor", 1.0))
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


def _yarn_inv_freq(rotary_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (models/rope_config.py resolves its parameters): each frequency blends the
    interpolated one (divided by factor) and the original, by a linear ramp over the dims
    between the ones that turn beta_fast and beta_slow times in original_max_position_embeddings
    positions (transformers' _compute_yarn_parameters, the same fp32 operations)."""
    factor = float(scaling["factor"])
    original = int(scaling["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp(
        (torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1
    )
    keep = 1 - ramp  # the share of the original frequency
    return interpolation * (1 - keep) + extrapolation * keep


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a cos/sin table [P, rotary_dim] indexed by
    position; the dims of a head past rotary_dim pass through."""

    def __init__(
        self,
        rotary_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict,
        device,
        kernels: KernelPlan | None = None,
    ):
        super().__init__()
        self.kernels = kernels or KernelPlan.reference()
        self.rotary_dim = rotary_dim
        inv_freq = rope_inv_freq(rotary_dim, theta, scaling, max_positions)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [P, R/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, R]
        # LongRoPE and YaRN scale cos and sin (in fp32, before the cast to the activation dtype)
        scale = float(scaling.get("attention_factor", 1.0))
        self.register_buffer("cos_cache", (emb.cos() * scale).to(device), persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * scale).to(device), persistent=False)

    @classmethod
    def for_model(cls, cfg, max_positions: int, device, kernels: KernelPlan | None = None):
        """The rotary of ModelConfig `cfg` for contexts of up to max_positions."""
        return cls(cfg.rotary_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device, kernels)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (q, k). With the Triton kernels one kernel rotates q and k in place (strided
        views allowed) and returns them; else new tensors.
        """
        # q: [T, H, D], k: [T, KV, D], positions: [T]; the first R = rotary_dim of D rotate
        if self.kernels.triton_ops:
            apply_rotary_(q, k, positions, self.cos_cache, self.sin_cache, pdl=self.kernels.pdl)
            return q, k
        cos = self.cos_cache[positions].unsqueeze(1)  # [T, 1, R] fp32
        sin = self.sin_cache[positions].unsqueeze(1)
        return _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:  # partial rotary: the dims past rotary_dim pass through
        rotated = _apply_rotary(x[..., :rotary_dim], cos, sin)
        return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    # NOTE: HF multiplies in the activation dtype with cos/sin cast to it; do the same.
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)
