"""NVIDIA ModelOpt FP8 (`quant_method: modelopt`, `quant_algo: FP8`): per-tensor weights and
static per-tensor activations.

    "quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8",
                            "kv_cache_quant_algo": "FP8" | null,
                            "exclude_modules": ["lm_head", "model.layers.0.mlp*"]}

(also written with the settings under "quantization": {...}, as hf_quant_config.json has them,
and with "ignore" for "exclude_modules"). Tensors of a quantized linear: `weight`
float8_e4m3fn [out, in], `weight_scale` and `input_scale` float32 scalars. The attention's
`k_proj.k_scale` / `v_proj.v_scale` (FP8 KV cache) are read and kept on the attention.
"""

from __future__ import annotations

from typing import Any

from batchrun.errors import ModelConfigError
from batchrun.quant.formats.common import ModuleFilter, refuse, string_list
from batchrun.quant.formats.fp8_scheme import Fp8Scheme

QUANT_ALGOS = ("FP8",)
KV_CACHE_ALGOS = ("FP8",)


def parse(qcfg: dict[str, Any], source: str) -> Fp8Scheme:
    settings, prefix = qcfg, ""
    if isinstance(qcfg.get("quantization"), dict):
        settings, prefix = qcfg["quantization"], "quantization."
    algo = settings.get("quant_algo")
    if not isinstance(algo, str) or algo.upper() not in QUANT_ALGOS:
        raise refuse(source, f"{prefix}quant_algo", algo, ", ".join(QUANT_ALGOS))
    kv = settings.get("kv_cache_quant_algo")
    if kv is not None and (not isinstance(kv, str) or kv.upper() not in KV_CACHE_ALGOS):
        raise refuse(
            source, f"{prefix}kv_cache_quant_algo", kv, f"null, {', '.join(KV_CACHE_ALGOS)}"
        )
    key = "exclude_modules" if "exclude_modules" in settings else "ignore"
    exclude = string_list(settings, key, source)
    if settings.get("group_size") is not None:
        raise ModelConfigError(
            f"{source}: quantization_config.{prefix}group_size {settings['group_size']!r}: "
            "ModelOpt FP8 is per tensor; batchrun reads quant_algo FP8 without groups"
        )
    return Fp8Scheme(
        method="modelopt",
        weights="tensor",
        activations="static",
        ignore=ModuleFilter(exclude, "glob"),
    )
