"""RMSNorm, with the residual add before it fused into one kernel on the GPU."""

from __future__ import annotations

import torch
from torch import nn

from batchrun.config import KernelPlan

try:
    from batchrun.kernels.fused_norm import fused_add_rms_norm, rms_norm, rms_norm_heads
except ImportError:  # no Triton (CPU-only installs): KernelPlan.triton_ops is off
    fused_add_rms_norm = rms_norm = rms_norm_heads = None


class RMSNorm(nn.Module):
    def __init__(
        self,
        dim: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device | str,
        kernels: KernelPlan | None = None,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps
        self.kernels = kernels or KernelPlan.reference()

    def runs_triton(self, x: torch.Tensor) -> bool:
        """Whether this norm of x runs batchrun's Triton kernel (else the torch formula)."""
        return self.kernels.triton_ops and x.dtype == self.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.runs_triton(x):
            # NOTE: reshape copies a strided view (the q/k norms); the kernel writes a new
            # tensor anyway
            x2d = x.reshape(-1, x.shape[-1])
            return rms_norm(x2d, self.weight, self.eps, pdl=self.kernels.pdl).view(x.shape)
        # NOTE: normalize in fp32 and cast back before the weight, as HF transformers does, so
        # bf16/fp16 results match the reference bit for bit where possible.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) for x, residual [T, N]. With the Triton kernels
        one kernel writes both in place, into x and residual: callers must not read them
        afterwards.
        """
        if self.runs_triton(x) and residual.dtype == x.dtype:
            return fused_add_rms_norm(x, residual, self.weight, self.eps, pdl=self.kernels.pdl)
        residual = x + residual
        return self(residual), residual


def norm_heads_in_place(heads: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, num_q: int) -> bool:
    """The q and k norms on heads [T, num_q + KV, D] (the qkv projection's q heads, then its
    k heads: a strided view) in one Triton launch, in place, with the bits of q_norm(q) and
    k_norm(k) (two launches, each with a copy of its strided view first past one token).
    False: not taken (no Triton kernels, or another dtype); the caller applies the two norms."""
    if not q_norm.runs_triton(heads):
        return False
    rms_norm_heads(heads, q_norm.weight, k_norm.weight, num_q, q_norm.eps, pdl=q_norm.kernels.pdl)
    return True
