"""FP8 activation quantization: real (for torch._scaled_mm) and fake (quantize, then back to the
activation's dtype: the CPU's exact model of what the checkpoint's kernels compute).

    dynamic, per token               scale[t] = max |x[t, :]| / 448
    dynamic, per token and group     scale[t, g] = max |x[t, g*G : (g+1)*G]| / 448   (FP8 blocks)
    static                           scale = the checkpoint's input_scale

    q = clamp(x / scale, -448, 448) rounded to float8_e4m3fn (to nearest even)

A row-parallel layer's input is split by columns over the tensor-parallel ranks: its per-token
maximum is reduced over them (`reduce_max`, an all-reduce), so every TP size quantizes a token
as TP=1 does. (Groups of 128 columns never straddle two ranks.)

Fake quantization follows compressed-tensors' forward (llm-compressor's own model of these
checkpoints): the scale in x's dtype, a zero scale replaced by that dtype's eps, x divided by
it, q multiplied back. Everything runs on the device without host syncs (CUDA-graph safe).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchrun.quant.weights import FP8_DTYPE, FP8_MAX

# an in-place maximum over the tensor-parallel ranks (TPGroup.all_reduce_max); None: one rank
ReduceMax = Callable[[torch.Tensor], torch.Tensor] | None

# real quantization's smallest scale (an all-zero row quantizes to zeros)
MIN_SCALE = 1e-12
# real quantization's scale is amax times fp32(1 / 448), on every device and in the kernels
# (kernels/fp8_quant.py, fp8_gemv.py): torch divides by a Python scalar exactly on the CPU but as
# a multiplication by its reciprocal on CUDA, and an ulp of scale moves the e4m3 rounding of the
# values x / scale puts on a midpoint (frequent for bf16 x)
INV_FP8_MAX = 1.0 / FP8_MAX


def _fake(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.to(x.dtype) * scale


def _dynamic_scale(amax: torch.Tensor) -> torch.Tensor:
    scale = amax / FP8_MAX
    eps = torch.finfo(scale.dtype).eps
    return torch.where(scale == 0, torch.full_like(scale, eps), scale)


def fake_quant_dynamic(
    x: torch.Tensor, group: int | None = None, reduce_max: ReduceMax = None
) -> torch.Tensor:
    """x [T, K] quantized per token (group None) or per token and `group` columns, and back."""
    if group is None:
        amax = x.abs().amax(dim=-1, keepdim=True)
        if reduce_max is not None:
            amax = reduce_max(amax.contiguous())
        return _fake(x, _dynamic_scale(amax))
    num_tokens, cols = x.shape
    pad = -cols % group
    xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
    xg = xp.view(num_tokens, -1, group)  # [T, K / G, G]
    out = _fake(xg, _dynamic_scale(xg.abs().amax(dim=-1, keepdim=True)))
    return out.view(num_tokens, -1)[:, :cols]


def fake_quant_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x quantized with the per-tensor `scale` (float32 scalar), and back."""
    return _fake(x, scale.to(x.dtype))


def quant_per_token(
    x: torch.Tensor, reduce_max: ReduceMax = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as float8 [M, K] and its float32 scales [M, 1]: torch._scaled_mm's row-wise
    operand."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)  # [M, 1]
    if reduce_max is not None:
        amax = reduce_max(amax)
    scale = (amax * INV_FP8_MAX).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quant_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] as float8 with the per-tensor float32 `scale`."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
