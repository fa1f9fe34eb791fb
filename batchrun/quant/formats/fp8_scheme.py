"""The FP8 family's scheme, shared by its three checkpoint formats (compressed-tensors
float-quantized, ModelOpt FP8, quant_method fp8): they differ in their config and their tensor
names, not in what the tensors are.

    weight          float8_e4m3fn [out, in]
    weight scale    per tensor: one value; per channel: [out, 1] or [out]; blocks: [ceil(out /
                    block[0]), ceil(in / block[1])]; float32 (bf16 / fp16 read as float32)
    input scale     static activations: one value (float32)

W = weight * scale, whatever the checkpoint calls the scale (`weight_scale`, or DeepSeek's
`weight_scale_inv`, which despite its name multiplies too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchrun.errors import WeightLoadError
from batchrun.quant.formats.common import (
    FLOAT_SCALE_DTYPES,
    ModuleFilter,
    check_tensor,
    describe_tensor,
    scalar_shapes,
)
from batchrun.quant.weights import FP8_DTYPE, Fp8Weight

WEIGHT_STRATEGIES = ("tensor", "channel", "block")
_ACTIVATIONS = {
    "none": "weight-only (activations unquantized)",
    "static": "static per-tensor activations",
}


@dataclass(frozen=True)
class Fp8Scheme:
    method: str  # config.json's quant_method
    weights: str  # one of WEIGHT_STRATEGIES
    activations: str  # "none", "dynamic" or "static"
    block: tuple[int, int] | None = None  # with weights "block"
    # the weight scale's name; the first of them the checkpoint has is read
    scale_names: tuple[str, ...] = ("weight_scale",)
    input_scale_names: tuple[str, ...] = ("input_scale",)  # static activations
    ignore: ModuleFilter = ModuleFilter()
    # modules the scheme covers (compressed-tensors' targets); None: every linear
    targets: ModuleFilter | None = None
    family = "fp8"

    @property
    def tensor_names(self) -> tuple[str, ...]:
        names = ("weight",)
        if len(self.scale_names) == 1:
            names += self.scale_names
        if self.activations == "static" and len(self.input_scale_names) == 1:
            names += self.input_scale_names
        return names

    @property
    def optional_names(self) -> tuple[str, ...]:
        names = self.scale_names if len(self.scale_names) > 1 else ()
        if self.activations == "static" and len(self.input_scale_names) > 1:
            names += self.input_scale_names
        return names

    @property
    def format_name(self) -> str:
        """How messages name the format, e.g. "compressed-tensors FP8 (per-channel weights)"."""
        return f"{self.method} FP8 ({self._weights_text()})"

    def is_quantized(self, module: str) -> bool:
        if self.targets is not None and not self.targets.matches(module):
            return False
        return not self.ignore.matches(module)

    def decode(
        self, tensors: dict[str, torch.Tensor], out_features: int, in_features: int, where: str
    ) -> Fp8Weight:
        fmt = self.format_name
        weight = check_tensor(
            tensors, "weight", where, ((out_features, in_features),), (FP8_DTYPE,), fmt
        )
        name = self._first(tensors, self.scale_names, where)
        if self.weights == "tensor":
            shapes = scalar_shapes()
        elif self.weights == "channel":
            shapes = ((out_features, 1), (out_features,))
        else:
            bo, bi = self.block
            shapes = ((-(-out_features // bo), -(-in_features // bi)),)
        scale = check_tensor(tensors, name, where, shapes, FLOAT_SCALE_DTYPES, fmt).float()
        _check_finite(scale, f"{where}.{name}", fmt)
        if self.weights == "block":
            scale = scale.contiguous()
        else:  # one scale per output row
            scale = scale.reshape(-1).expand(out_features).contiguous()
        input_scale = None
        if self.activations == "static":
            name = self._first(tensors, self.input_scale_names, where)
            input_scale = check_tensor(
                tensors, name, where, scalar_shapes(), FLOAT_SCALE_DTYPES, fmt
            )
            input_scale = input_scale.float().reshape(())
            _check_finite(input_scale, f"{where}.{name}", fmt)
        return Fp8Weight(weight, scale, self.block, input_scale)

    def dummy(self, out_features: int, in_features: int, generator: torch.Generator):
        from batchrun.quant.dummy import random_fp8

        return random_fp8(
            out_features,
            in_features,
            self.weights,
            self.block,
            self.activations == "static",
            generator,
        )

    def describe(self) -> str:
        if self.activations == "dynamic":
            acts = "dynamic per-token" + (
                f" activations in groups of {self.block[1]}" if self.block else " activations"
            )
        else:
            acts = _ACTIVATIONS[self.activations]
        return f"fp8 ({self.method}, {self._weights_text()}, {acts})"

    def _weights_text(self) -> str:
        if self.weights == "block":
            return f"{self.block[0]}x{self.block[1]}-block weights"
        return f"per-{self.weights} weights"

    def _first(self, tensors: dict[str, torch.Tensor], names: tuple[str, ...], where: str) -> str:
        """The first of `names` the linear has (the missing one's error names them all)."""
        for name in names:
            if name in tensors:
                return name
        if len(names) == 1:
            return names[0]  # check_tensor says it is missing
        raise WeightLoadError(
            f"the checkpoint lacks {where}.{names[0]} (or {', '.join(names[1:])}), which "
            f"{self.format_name} needs"
        )


def _check_finite(scale: torch.Tensor, name: str, fmt: str) -> None:
    if not torch.isfinite(scale).all():
        raise WeightLoadError(
            f"{name} ({describe_tensor(scale)}) holds scales that are not finite; the "
            f"checkpoint is damaged ({fmt})"
        )
