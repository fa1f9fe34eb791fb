"""A mixture of experts' per-expert checkpoint tensors, stacked at load into layers/moe.py's
weights:

    {block}.experts.{e}.{gate}.weight  [I, H]  ->  mlp.w13[e, 0:I]      (the gate rows)
    {block}.experts.{e}.{up}.weight    [I, H]  ->  mlp.w13[e, I:2I]     (the up rows)
    {block}.experts.{e}.{down}.weight  [H, I]  ->  mlp.w2[e]

with {block} and the three names from MoeConfig (mlp / gate_proj, up_proj, down_proj by
default; the architecture's spec may name them otherwise). Offsets are in the full (TP=1) width
I; a rank reads only the rows (columns of down) of its slice (the parameter's ShardSpec).

A quantized checkpoint's experts (the linears its quantization_config covers: 128x128-block FP8
`weight` + `weight_scale_inv`, or any format of batchrun/quant/formats) are decoded, dequantized
in fp32 at full (TP=1) size and stacked like plain ones: w13 and w2 hold the dequantized weights
in the model's dtype, which the MoE paths (layers/moe.py) run as they run a bf16 checkpoint's.
A rank slices the dequantized tensor, so its slice need not fall on the format's blocks or
groups (a width of 768 at --tp 4: 192 rows, half a block). The experts' activations are not
quantized (the checkpoint's dynamic activation scheme applies to its other linears).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from batchrun.errors import WeightLoadError
from batchrun.models.config import ModelConfig
from batchrun.parallel.partition import ShardSpec

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\.weight$")


class ExpertTensor(NamedTuple):
    param: str  # our parameter: layers.{i}.mlp.w13 or .w2
    expert: int
    segment: int  # 0 gate, 1 up, 2 down


def expert_target(name: str, cfg: ModelConfig) -> ExpertTensor | None:
    """The expert tensor `name` is, or None for any other tensor."""
    moe = cfg.moe
    m = _EXPERT.match(name) if moe is not None else None
    if m is None or m.group(2) != moe.block_name or m.group(4) not in moe.expert_names:
        return None
    segment = moe.expert_names.index(m.group(4))
    param = f"layers.{m.group(1)}.mlp.{'w2' if segment == 2 else 'w13'}"
    return ExpertTensor(param, int(m.group(3)), segment)


def load_expert(
    target: ExpertTensor,
    param: torch.Tensor,
    spec: ShardSpec,
    sliced,
    path: Path,
    name: str,
    cfg: ModelConfig,
) -> int:
    """Copy this rank's slice of the safetensors slice `sliced` (tensor `name`) into expert
    `target.expert` of `param`; returns the elements filled."""
    width, hidden = cfg.moe.intermediate_size, cfg.hidden_size
    if not 0 <= target.expert < param.shape[0]:
        raise WeightLoadError(
            f"{path.name}: tensor {name!r} is expert {target.expert}, but config.json has "
            f"{param.shape[0]} experts; check that config.json matches the weights"
        )
    expected = (hidden, width) if target.segment == 2 else (width, hidden)
    shape = tuple(sliced.get_shape())
    if shape != expected:
        raise WeightLoadError(
            f"{path.name}: tensor {name!r} has shape {shape}, expected {expected} from config.json"
        )
    if sliced.get_dtype() not in ("F64", "F32", "F16", "BF16"):
        raise WeightLoadError(
            f"{path.name}: tensor {name!r} is {sliced.get_dtype()}, a quantized tensor, where "
            "batchrun reads a plain weight: config.json has no quantization_config covering "
            "this expert"
        )
    return fill_expert(target, param, spec, sliced, width)


def fill_expert(
    target: ExpertTensor, param: torch.Tensor, spec: ShardSpec, full, width: int
) -> int:
    """Copy this rank's slice of `full` (expert `target.expert`'s [I, H] gate or up, or [H, I]
    down, at full size: a tensor or a safetensors slice) into `param`; returns the elements
    filled."""
    expert = param.data[target.expert]  # [2I, H] or [H, I] of this rank
    filled = 0
    if target.segment == 2:  # down: this rank's columns
        for src, dst, n in spec.pieces(0, width):
            dest = expert.narrow(1, dst, n)
            dest.copy_(full[:, src : src + n].to(dest.dtype))
            filled += dest.numel()
        return filled
    for src, dst, n in spec.pieces(target.segment * width, width):  # gate or up: its rows
        dest = expert.narrow(0, dst, n)
        dest.copy_(full[src : src + n].to(dest.dtype))
        filled += dest.numel()
    return filled


def quantized_experts(cfg: ModelConfig) -> Iterator[tuple[str, ExpertTensor, int, int]]:
    """(checkpoint linear, its place in w13 / w2, rows, columns at full size) of every expert
    linear the model's quantization scheme covers; none for a dense or plain model, nor for
    experts that the spec's own reader reads (stacked tensors, no linears: plain)."""
    moe, scheme = cfg.moe, cfg.quantization
    if moe is None or scheme is None or cfg.spec.experts_reader is not None:
        return
    width, hidden = moe.intermediate_size, cfg.hidden_size
    for i in moe.layers:
        for e in range(moe.num_experts):
            for segment, proj in enumerate(moe.expert_names):
                where = f"model.layers.{i}.{moe.block_name}.experts.{e}.{proj}"
                if not scheme.is_quantized(where):
                    continue
                param = f"layers.{i}.mlp.{'w2' if segment == 2 else 'w13'}"
                shape = (hidden, width) if segment == 2 else (width, hidden)
                yield where, ExpertTensor(param, e, segment), *shape


def load_quantized_experts(model, source: Callable) -> dict[str, int]:
    """Fill the quantized experts of `model` from `source` (models/quant_loader.py's: a linear's
    decoded weight at full size), dequantized; returns the elements filled per parameter."""
    params = dict(model.named_parameters())
    specs = model.param_shards()
    filled: dict[str, int] = {}
    width = model.config.moe.intermediate_size if model.config.moe is not None else 0
    for where, target, rows, cols in quantized_experts(model.config):
        weight = source(where, rows, cols).dequantize(torch.float32)
        param = params[target.param]
        n = fill_expert(target, param, specs[target.param], weight, width)
        filled[target.param] = filled.get(target.param, 0) + n
    return filled


def has_quantized_experts(cfg: ModelConfig) -> bool:
    """Whether the checkpoint stores any expert quantized (which then runs dequantized)."""
    return next(quantized_experts(cfg), None) is not None


def describe_experts(cfg: ModelConfig) -> str:
    """What the start-up log and `plan` add to a quantized mixture's format: "" otherwise."""
    if not has_quantized_experts(cfg):
        return ""
    return "; the experts dequantized at load (run in the model's dtype)"
