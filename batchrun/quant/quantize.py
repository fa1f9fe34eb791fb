"""FP8 quantization of a weight at load time: `--quantization fp8` (per output channel) and the
dummy FP8 weights (every strategy). Round to nearest, scales from each slice's absolute maximum,
computed in float32 on the weight's device."""

from __future__ import annotations

import torch

from batchrun.quant.weights import FP8_DTYPE, FP8_MAX, Fp8Weight

# a scale never below this: an all-zero row quantizes to zeros with a finite scale
MIN_SCALE = 1e-12


def quantize_fp8(
    w: torch.Tensor,
    weights: str = "channel",
    block: tuple[int, int] | None = None,
    input_scale: torch.Tensor | None = None,
) -> Fp8Weight:
    """w [out, in] as an Fp8Weight: one scale per output row ("channel"), one for the whole
    tensor ("tensor", stored per row), or one per block[0] x block[1] block ("block")."""
    w = w.float()
    out_features, in_features = w.shape
    if weights == "block":
        bo, bi = block
        rows, cols = -(-out_features // bo), -(-in_features // bi)
        padded = w.new_zeros(rows * bo, cols * bi)
        padded[:out_features, :in_features] = w
        amax = padded.view(rows, bo, cols, bi).abs().amax(dim=(1, 3))  # [rows, cols]
        scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
        expanded = scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)
        expanded = expanded[:out_features, :in_features]
        q = (w / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return Fp8Weight(q, scale, block, input_scale)
    if weights == "channel":
        amax = w.abs().amax(dim=1)  # [out]
    elif weights == "tensor":
        amax = w.abs().amax().expand(out_features)
    else:
        raise ValueError(f"FP8 weight strategy {weights!r} is not one of channel, tensor, block")
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE).contiguous()
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(q, scale, None, input_scale)
