"""`--quantization fp8`: a bf16 / fp16 / fp32 checkpoint's decoder linears quantized to FP8 at
load time, one scale per output channel, with activations quantized per token at run time (the
scheme of compressed-tensors' FP8_DYNAMIC). Embeddings and lm_head stay as they are, and so do a
mixture of experts' router and experts (its attention and shared-expert linears are quantized).

It is a Scheme like the checkpoint formats' (batchrun/quant/formats): the loader reads each
linear's `weight` and `decode` quantizes it, on the device the model loads to."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from batchrun.errors import WeightLoadError
from batchrun.quant.dummy import random_fp8
from batchrun.quant.formats.common import describe_tensor
from batchrun.quant.quantize import quantize_fp8
from batchrun.quant.weights import Fp8Weight


@dataclass(frozen=True)
class OnlineFp8Scheme:
    family = "fp8"
    method = "online"
    activations = "dynamic"
    block = None
    tensor_names = ("weight",)
    optional_names = ()

    def is_quantized(self, module: str) -> bool:
        # a mixture's experts stay in the checkpoint's dtype: the MoE paths run plain weights
        # (a quantized checkpoint's experts run dequantized, which would save nothing here)
        return ".experts." not in module

    def decode(
        self, tensors: dict[str, torch.Tensor], out_features: int, in_features: int, where: str
    ) -> Fp8Weight:
        w = tensors["weight"]
        if tuple(w.shape) != (out_features, in_features) or not w.is_floating_point():
            raise WeightLoadError(
                f"{where}.weight has {describe_tensor(w)}; --quantization fp8 expects shape "
                f"{(out_features, in_features)} in a float dtype (a bf16 / fp16 / fp32 checkpoint)"
            )
        if w.dtype == torch.float8_e4m3fn:
            raise WeightLoadError(
                f"{where}.weight is float8 already; --quantization fp8 quantizes bf16 / fp16 / "
                "fp32 checkpoints: drop the option"
            )
        return quantize_fp8(w, "channel")

    def dummy(self, out_features: int, in_features: int, generator: torch.Generator):
        return random_fp8(out_features, in_features, "channel", None, False, generator)

    def describe(self) -> str:
        return (
            "fp8 (--quantization fp8: per-channel weights quantized at load, dynamic per-token "
            "activations)"
        )


def with_quantization(model_cfg, quantization: str | None, model: str | None):
    """model_cfg with the scheme of `quantization` (EngineConfig.quantization) for the model
    `model` (EngineConfig.model); ValueError where it cannot apply: a checkpoint that is
    quantized already (its own format runs), or a GGUF model (the embedded one included: its
    weights are quantized GGUF blocks)."""
    if quantization is None:
        return model_cfg
    if model is None or str(model).endswith(".gguf"):
        what = "the embedded model" if model is None else model
        raise ValueError(
            f"--quantization {quantization}: {what} is a GGUF model, quantized already; "
            "--quantization quantizes bf16 / fp16 / fp32 safetensors checkpoints"
        )
    if model_cfg.quantization is not None:
        raise ValueError(
            f"--quantization {quantization}: {model} is quantized already "
            f"({model_cfg.quantization.describe()}, from config.json's quantization_config); "
            "drop the option to run it as it is"
        )
    return replace(model_cfg, quantization=OnlineFp8Scheme())
