"""What the INT4 checkpoint formats (awq.py, gptq.py, compressed_tensors_int4.py) share beyond
common.py: reading their quantization_config fields (with older spellings and defaults), group
sizes, unpacking 4-bit values from int32 words, and act-order's g_idx.

Every format packs eight 4-bit values into one int32 word, value i in bits [4i, 4i + 4); they
differ in which element goes to which nibble (AWQ interleaves the output columns, GPTQ packs
input rows, compressed-tensors packs input columns in order) and in what the value means.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from batchrun.errors import ModelConfigError, WeightLoadError
from batchrun.quant.formats.common import FLOAT_SCALE_DTYPES, refuse

PACK = 8  # 4-bit values per int32 word
# NOTE: the group sizes that published INT4 checkpoints use and that the W4A16 GPU kernels of
# the field run (Marlin, Machete, the AWQ and GPTQ kernels: 32, 64, 128, or one group per row,
# -1, where the format has it). Other sizes would decode the same, but no W4A16 GPU kernel runs
# them: batchrun refuses them at start-up, listing these.
SUPPORTED_GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = FLOAT_SCALE_DTYPES
INT_DTYPES = (torch.int32, torch.int64)
REQUIRED = object()  # read_field's default for a field that must be present


def read_field(
    qcfg: Mapping[str, Any],
    keys: tuple[str, ...],
    source: str,
    method: str,
    supported: tuple[Any, ...],
    default: Any = REQUIRED,
    path: str = "",
) -> Any:
    """The value of the first of `keys` (a field and its older spellings) present in `qcfg`
    (quantization_config, or the part of it at `path`, e.g. "config_groups.group_0.weights.");
    strings compare lower-cased. Raises ModelConfigError naming the field, its value and what is
    supported when the value is not in `supported`, or when it is missing without a default."""
    key = next((k for k in keys if qcfg.get(k) is not None), None)  # null: absent
    if key is None:
        if default is REQUIRED:
            raise ModelConfigError(
                f"{source}: quantization_config lacks {path}{keys[0]}; supported: "
                f"{one_of(supported)} ({method})"
            )
        return default
    value = qcfg[key]
    norm = value.lower() if isinstance(value, str) else value
    # NOTE: True == 1 in Python: a bool only matches a bool, and a number only a number
    if not any(norm == s and isinstance(norm, bool) == isinstance(s, bool) for s in supported):
        raise refuse(source, path + key, value, f"{one_of(supported)} ({method})")
    return norm


def read_group_size(
    qcfg: Mapping[str, Any],
    keys: tuple[str, ...],
    source: str,
    method: str,
    per_row: bool,
    path: str = "",
) -> int:
    """The group size (-1: one group per output row, where `per_row` allows it)."""
    sizes = (*SUPPORTED_GROUP_SIZES, -1) if per_row else SUPPORTED_GROUP_SIZES
    return read_field(qcfg, keys, source, method, sizes, path=path)


def one_of(values: tuple[Any, ...]) -> str:
    return ", ".join("null" if v is None else str(v).lower() for v in values)


def require_divisible(where: str, what: str, size: int, unit: int, why: str) -> None:
    if size % unit:
        raise WeightLoadError(f"{where}: {what} {size} is not a multiple of {unit} ({why})")


def num_groups(in_features: int, group_size: int) -> int:
    """Groups per row (a group size of -1 or at least in_features: one)."""
    if group_size == -1:
        return 1
    return -(-in_features // group_size)


def describe_groups(group_size: int) -> str:
    return "one group per row" if group_size == -1 else f"group size {group_size}"


def effective_group_size(in_features: int, group_size: int) -> int:
    """Int4Weight's group_size: -1 (one group per row) becomes the row's length."""
    return in_features if group_size == -1 else group_size


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> uint8 [..., n, 8]: each word's eight 4-bit values, lowest bits first."""
    out = torch.empty(*packed.shape, PACK, dtype=torch.uint8, device=packed.device)
    for i in range(PACK):
        out[..., i] = (packed >> (4 * i)) & 0xF
    return out


def check_g_idx(g_idx: torch.Tensor, groups: int, where: str, name: str) -> torch.Tensor:
    """g_idx as int32, every entry a group of the row."""
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise WeightLoadError(
            f"tensor {where}.{name} holds groups from {int(g_idx.min())} to {int(g_idx.max())}; "
            f"expected groups 0 to {groups - 1} (the rows of the scales)"
        )
    return g_idx.to(torch.int32)


def sequential_g_idx(g_idx: torch.Tensor, group_size: int) -> bool:
    """Whether g_idx only restates column i's group i // group_size (no reordering)."""
    expected = torch.arange(g_idx.numel(), device=g_idx.device) // group_size
    return bool(torch.equal(g_idx.long(), expected))
