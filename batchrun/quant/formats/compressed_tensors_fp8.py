"""compressed-tensors FP8 (llm-compressor's FP8, FP8_DYNAMIC, FP8_BLOCK schemes), format
"float-quantized" or "naive-quantized":

    "quantization_config": {
      "quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "symmetric": true,
                    "strategy": "channel" | "tensor" | "block", "block_structure": [128, 128],
                    "dynamic": false},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": true,
                              "strategy": "token" (dynamic) | "tensor" (static) | "group"
                              (dynamic, group_size 128, with block weights)} | null}},
      "ignore": ["lm_head", "re:.*mlp.gate$"],
      "kv_cache_scheme": null | {...}      (its k_scale / v_scale are read and kept)
    }

Tensors of a quantized linear: `weight` float8_e4m3fn [out, in], `weight_scale` ([1] per tensor,
[out, 1] per channel, [out / 128, in / 128] per block), `input_scale` [1] for static activations.
"""

from __future__ import annotations

from typing import Any

from batchrun.errors import ModelConfigError
from batchrun.quant.formats.common import ModuleFilter, refuse, string_list
from batchrun.quant.formats.fp8_scheme import Fp8Scheme

BLOCK = (128, 128)
_WEIGHTS = ("tensor", "channel", "block")
# input_activations (strategy, dynamic) with per-tensor / per-channel weights -> activations
_INPUTS = {("token", True): "dynamic", ("tensor", False): "static"}


def parse(qcfg: dict[str, Any], source: str) -> Fp8Scheme:
    groups = qcfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelConfigError(
            f"{source}: quantization_config.config_groups is missing or empty; a "
            "compressed-tensors checkpoint lists its quantization schemes there"
        )
    first_name, first = next(iter(groups.items()))
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise ModelConfigError(
                f"{source}: quantization_config.config_groups.{name} is {group!r}; batchrun "
                "reads config groups written out in full (targets, weights, input_activations)"
            )
        if _settings(group) != _settings(first):
            raise ModelConfigError(
                f"{source}: quantization_config.config_groups {first_name} and {name} quantize "
                "differently; batchrun runs one FP8 scheme per model"
            )
    where = f"config_groups.{first_name}"
    weights, block = _weights(first.get("weights"), f"{where}.weights", source)
    activations = _inputs(first.get("input_activations"), weights, f"{where}", source)
    if first.get("output_activations") is not None:
        raise refuse(source, f"{where}.output_activations", first["output_activations"], "null")
    targets: list[str] = []
    for group in groups.values():
        targets += string_list(group, "targets", source)
    return Fp8Scheme(
        method="compressed-tensors",
        weights=weights,
        activations=activations,
        block=block,
        ignore=ModuleFilter(string_list(qcfg, "ignore", source), "compressed-tensors"),
        targets=ModuleFilter(tuple(targets), "compressed-tensors"),
    )


def _settings(group: dict[str, Any]) -> tuple:
    return tuple(repr(group.get(k)) for k in ("weights", "input_activations", "output_activations"))


def _weights(args: Any, field: str, source: str) -> tuple[str, tuple[int, int] | None]:
    if not isinstance(args, dict):
        raise refuse(source, field, args, "FP8 weights (num_bits 8, type float)")
    _check_float8(args, field, source)
    if args.get("dynamic"):
        raise refuse(source, f"{field}.dynamic", args["dynamic"], "false")
    strategy = args.get("strategy") or "tensor"
    if strategy not in _WEIGHTS:
        raise refuse(source, f"{field}.strategy", strategy, ", ".join(_WEIGHTS))
    if strategy != "block":
        return strategy, None
    block = args.get("block_structure")
    if block != list(BLOCK):
        raise refuse(source, f"{field}.block_structure", block, str(list(BLOCK)))
    return strategy, BLOCK


def _inputs(args: Any, weights: str, where: str, source: str) -> str:
    field = f"{where}.input_activations"
    if args is None:
        return "none"
    if not isinstance(args, dict):
        raise refuse(source, field, args, "null or FP8 activations (num_bits 8, type float)")
    _check_float8(args, field, source)
    strategy, dynamic, group = args.get("strategy"), args.get("dynamic"), args.get("group_size")
    if weights == "block":
        # NOTE: the block kernels quantize activations per token in groups of 128 columns,
        # whether the config says "group" (FP8_BLOCK) or "token"
        if dynamic is True and (strategy == "token" or (strategy == "group" and group == BLOCK[1])):
            return "dynamic"
        supported = f"dynamic true with strategy group (group_size {BLOCK[1]}) or token"
    else:
        mode = _INPUTS.get((strategy, dynamic))
        if mode is not None:
            return mode
        supported = "strategy token with dynamic true, or strategy tensor with dynamic false"
    value = {"strategy": strategy, "dynamic": dynamic, "group_size": group}
    raise refuse(source, field, value, supported)


def _check_float8(args: dict[str, Any], field: str, source: str) -> None:
    if args.get("num_bits") != 8:
        raise refuse(source, f"{field}.num_bits", args.get("num_bits"), "8")
    if args.get("type") != "float":
        raise refuse(source, f"{field}.type", args.get("type"), "float (FP8 e4m3)")
    if args.get("symmetric") is False:
        raise refuse(source, f"{field}.symmetric", False, "true")
