"""A mixture of experts' per-expert checkpoint tensors, stacked at load into layers/moe.py's
weights:

    {block}.experts.{e}.{gate}.weight  [I, H]  ->  mlp.w13[e, 0:I]      (the gate rows)
    {block}.experts.{e}.{up}.weight    [I, H]  ->  mlp.w13[e, I:2I]     (the up rows)
    {block}.experts.{e}.{down}.weight  [H, I]  ->  mlp.w2[e]

with {block} and the three names from MoeConfig: Qwen's mlp / gate_proj, up_proj, down_proj,
Mixtral's block_sparse_moe / w1, w3, w2. Offsets are in the full (TP=1) width I; a rank reads
only the rows (columns of down) of its slice (the parameter's ShardSpec).
"""

from __future__ import annotations

import re
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
            f"{path.name}: tensor {name!r} is {sliced.get_dtype()}, a quantized tensor; "
            "batchrun runs a mixture of experts from bf16 / fp16 / fp32 weights"
        )
    expert = param.data[target.expert]  # [2I, H] or [H, I] of this rank
    filled = 0
    if target.segment == 2:  # down: this rank's columns
        for src, dst, n in spec.pieces(0, width):
            dest = expert.narrow(1, dst, n)
            dest.copy_(sliced[:, src : src + n].to(dest.dtype))
            filled += dest.numel()
        return filled
    for src, dst, n in spec.pieces(target.segment * width, width):  # gate or up: its rows
        dest = expert.narrow(0, dst, n)
        dest.copy_(sliced[src : src + n].to(dest.dtype))
        filled += dest.numel()
    return filled
