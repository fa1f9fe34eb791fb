"""What the device and the installed packages run: the probes engine/kernel_choice.py's rules
read (each False off CUDA)."""

from __future__ import annotations

import importlib
import importlib.util

import torch


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _check_kernels_import(module: str = "batchrun.kernels.gemv") -> None:
    """batchrun's Triton kernels import (an install without them fails here, not mid-start)."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"batchrun's Triton kernels (batchrun.kernels) do not import ({e}); install batchrun "
            "(pip install ., or pip install -e . in a checkout) so that they are part of it"
        ) from e


def supports_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: sm_90 (Hopper) and later; older GPUs reject the launch
    attribute."""
    if device.type != "cuda":
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch.cuda.get_device_capability(index)[0] >= 9


def supports_fp8_matmul(device: torch.device) -> bool:
    """torch._scaled_mm's FP8 tensor cores: sm_89 (Ada) and later."""
    if device.type != "cuda":
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch.cuda.get_device_capability(index) >= (8, 9)


def supports_block_scaled_mm(device: torch.device) -> bool:
    """torch's scaled_mm with DeepSeek-style block scales (BlockWise1x128 activations,
    BlockWise128x128 weights): cuBLASLt's, on sm_90 with a torch built with CUDA 12.9+."""
    if device.type != "cuda" or not hasattr(torch.nn.functional, "ScalingType"):
        return False
    if tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2]) < (12, 9):
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch.cuda.get_device_capability(index) == (9, 0)


def supports_grouped_mm(device: torch.device) -> bool:
    """torch._grouped_mm on CUTLASS's grouped GEMM (bf16, no host sync): sm_90."""
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch.cuda.get_device_capability(index) == (9, 0)


def supports_int4_gemv_mma(device: torch.device) -> bool:
    """kernels/int4_gemv_mma.py: Triton with Gluon (it imports) and bf16 MMAs (sm_80+)."""
    if device.type != "cuda":
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    if torch.cuda.get_device_capability(index) < (8, 0):
        return False
    try:
        importlib.import_module("batchrun.kernels.int4_gemv_mma")
    except ImportError:
        return False
    return True
