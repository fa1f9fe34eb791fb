"""Random quantized weights for `--load-format dummy` with a quantization_config: a scheme's
`dummy()` draws one linear at its full (TP=1) size on the generator's device, in the scheme's
shape (FP8 blocks, INT4 groups; no g_idx), and the loader slices it for tensor parallelism like
a checkpoint's. Values near a real checkpoint's: weights ~ normal(0, DUMMY_STD)."""

from __future__ import annotations

import torch

from batchrun.quant.quantize import quantize_fp8
from batchrun.quant.weights import Fp8Weight, Int4Weight

DUMMY_STD = 0.02
# the static activation scale of dummy FP8 weights: activations up to 8 in magnitude
DUMMY_INPUT_SCALE = 8.0 / 448.0


def _normal(out_features: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    w = torch.empty(out_features, in_features, device=generator.device)
    return w.normal_(0.0, DUMMY_STD, generator=generator)


def random_fp8(
    out_features: int,
    in_features: int,
    weights: str,
    block: tuple[int, int] | None,
    static: bool,
    generator: torch.Generator,
) -> Fp8Weight:
    """A normal(0, DUMMY_STD) weight quantized per `weights` ("tensor", "channel", "block")."""
    input_scale = None
    if static:
        input_scale = torch.tensor(DUMMY_INPUT_SCALE, device=generator.device)
    return quantize_fp8(_normal(out_features, in_features, generator), weights, block, input_scale)


def random_int4(
    out_features: int,
    in_features: int,
    group_size: int,
    generator: torch.Generator,
    symmetric: bool = True,
) -> Int4Weight:
    """Values 0..15 around the zero point 8 (symmetric) or random zero points, with scales that
    give the weight a spread near DUMMY_STD; group_size -1: one group per row."""
    device = generator.device
    group = in_features if group_size == -1 else group_size
    num_groups = -(-in_features // group)
    q = torch.randint(0, 16, (out_features, in_features), generator=generator, device=device)
    scales = torch.full((out_features, num_groups), DUMMY_STD / 4.6, device=device)
    if symmetric:
        zeros = torch.full((out_features, num_groups), 8, device=device)
    else:
        zeros = torch.randint(6, 11, (out_features, num_groups), generator=generator, device=device)
    return Int4Weight(q.to(torch.uint8), scales.half(), zeros.to(torch.uint8), group)
