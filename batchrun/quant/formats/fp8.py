"""`quant_method: fp8`: block-wise FP8 (Qwen3 "-FP8", DeepSeek V3 style) and per-tensor FP8
(AutoFP8, transformers' FineGrainedFP8 without blocks).

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                            "activation_scheme": "dynamic" | "static",
                            "weight_block_size": [128, 128] | absent,
                            "ignored_layers" | "modules_to_not_convert": ["lm_head"]}

With weight_block_size: `weight` float8_e4m3fn [out, in] and `weight_scale_inv` float32
[ceil(out / 128), ceil(in / 128)] (which multiplies, despite its name); activations quantized per
token in groups of 128 columns (dynamic only). Without it: one `weight_scale` (or
`weight_scale_inv`) per tensor, and activations per token ("dynamic") or with the static
`input_scale` (or `activation_scale`).
"""

from __future__ import annotations

from typing import Any

from batchrun.quant.formats.common import ModuleFilter, refuse, string_list
from batchrun.quant.formats.fp8_scheme import Fp8Scheme

BLOCK = (128, 128)
ACTIVATION_SCHEMES = ("dynamic", "static")


def parse(qcfg: dict[str, Any], source: str) -> Fp8Scheme:
    fmt = qcfg.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise refuse(source, "fmt", fmt, "e4m3")
    scale_fmt = qcfg.get("scale_fmt")
    if scale_fmt not in (None, "float"):
        raise refuse(source, "scale_fmt", scale_fmt, "float (float32 scales)")
    acts = qcfg.get("activation_scheme", "dynamic")
    if acts not in ACTIVATION_SCHEMES:
        raise refuse(source, "activation_scheme", acts, ", ".join(ACTIVATION_SCHEMES))
    ignored = string_list(qcfg, "ignored_layers", source) + string_list(
        qcfg, "modules_to_not_convert", source
    )
    ignore = ModuleFilter(ignored, "substring")
    block = qcfg.get("weight_block_size")
    if block is None:
        return Fp8Scheme(
            method="fp8",
            weights="tensor",
            activations=acts,
            scale_names=("weight_scale", "weight_scale_inv"),
            input_scale_names=("input_scale", "activation_scale"),
            ignore=ignore,
        )
    if not isinstance(block, (list, tuple)) or list(block) != list(BLOCK):
        raise refuse(source, "weight_block_size", block, f"{list(BLOCK)}, or none (per tensor)")
    if acts != "dynamic":
        raise refuse(
            source, "activation_scheme", acts, "dynamic (with weight_block_size; static without)"
        )
    return Fp8Scheme(
        method="fp8",
        weights="block",
        activations="dynamic",
        block=BLOCK,
        scale_names=("weight_scale_inv",),
        ignore=ignore,
    )
