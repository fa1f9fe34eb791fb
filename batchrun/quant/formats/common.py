"""What the format modules share: module-name filters (ignore lists), tensor checks, and the
config field readers whose errors name the field."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

import torch

from batchrun.errors import ModelConfigError, WeightLoadError

FLOAT_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ModuleFilter:
    """Which checkpoint modules a list of names selects, in one of the formats' dialects:

    "compressed-tensors"  an exact name, or "re:REGEX" matched from the start (re.match); the
                          class name "Linear" selects every linear
    "glob"                ModelOpt: an exact name, a shell pattern ("*.mlp.down_proj",
                          "model.layers.0.self_attn*"), or a name the module's contains
    "substring"           transformers' modules_to_not_convert / ignored_layers: a name the
                          module's contains ("lm_head")
    """

    patterns: tuple[str, ...] = ()
    dialect: str = "substring"

    def matches(self, module: str) -> bool:
        return any(self._matches(p, module) for p in self.patterns)

    def _matches(self, pattern: str, module: str) -> bool:
        if pattern == module:
            return True
        if self.dialect == "compressed-tensors":
            if pattern.startswith("re:"):
                return re.match(pattern[3:], module) is not None
            return pattern == "Linear"
        if self.dialect == "glob" and fnmatch.fnmatchcase(module, pattern):
            return True
        return "*" not in pattern and pattern in module


def string_list(qcfg: dict[str, Any], key: str, source: str) -> tuple[str, ...]:
    """quantization_config[key] as a tuple of strings (absent or null: empty)."""
    value = qcfg.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelConfigError(
            f"{source}: quantization_config.{key} must be a list of module names; got {value!r}"
        )
    return tuple(value)


def refuse(source: str, field: str, value: Any, supported: str) -> ModelConfigError:
    """The error for a setting batchrun does not run."""
    return ModelConfigError(
        f"{source}: quantization_config.{field} {value!r} is not supported; supported: {supported}"
    )


def describe_tensor(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def check_tensor(
    tensors: dict[str, torch.Tensor],
    suffix: str,
    where: str,
    shapes: tuple[tuple[int, ...], ...],
    dtypes: tuple[torch.dtype, ...],
    fmt: str,
) -> torch.Tensor:
    """tensors[suffix], checked against the shapes (any of them) and dtypes its format allows;
    WeightLoadError naming `where.suffix`, what it is and what `fmt` expects."""
    name = f"{where}.{suffix}"
    t = tensors.get(suffix)
    if t is None:
        raise WeightLoadError(f"the checkpoint lacks {name}, which {fmt} needs")
    if tuple(t.shape) not in shapes or t.dtype not in dtypes:
        want_shapes = " or ".join(str(s) for s in shapes)
        want_dtypes = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise WeightLoadError(
            f"{name} has {describe_tensor(t)}; {fmt} expects shape {want_shapes} {want_dtypes}"
        )
    return t


def scalar_shapes() -> tuple[tuple[int, ...], ...]:
    """The shapes a per-tensor scale is stored in: (), (1,), (1, 1)."""
    return ((), (1,), (1, 1))
