"""Which linears a checkpoint stores quantized, where its config leaves that open.

A quantization_config that selects linears by class (compressed-tensors' target "Linear") or
selects every linear (no targets) says what a quantizer would quantize, not what it did: the
quantizer quantizes the modules that are `nn.Linear` when it runs. Under transformers 5 a
Qwen3-MoE's experts are one fused module, not linears, so a checkpoint quantized (or saved)
there holds its experts plain (`experts.{e}.gate_proj.weight` in bf16, no `weight_scale`) under
a config whose "Linear" target covers them. transformers loads what the checkpoint holds, and so
does batchrun: for such a linear the checkpoint's tensors decide. A linear that a target names
(its exact name or a "re:" pattern) stays quantized, and a missing scale is an error there.

    scheme = bind_checkpoint(parse(...), "path/config.json")
    scheme.is_quantized("model.layers.0.mlp.experts.3.gate_proj")   # False: only .weight there

A multimodal checkpoint stores its text model under another prefix (model.language_model.layers.0
for model.layers.0): bound with the spec's `text_name`, the scheme is asked text-model names,
and a module is left out where the config's ignore list names it either way (its text name or
the name it has in the checkpoint).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from batchrun.quant.formats.common import ModuleFilter

PLAIN_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
# tensor suffixes that a plain linear has too, or that say nothing about the format
_NOT_MARKERS = frozenset({"weight", "bias", "weight_shape"})


@dataclass(frozen=True)
class CheckpointScheme:
    """A Scheme whose `is_quantized` asks the checkpoint's tensor names where the scheme's
    targets select a linear by class; everything else is the wrapped scheme's."""

    scheme: Any
    names: frozenset[str]  # every tensor name of the checkpoint (the text model's)
    plain: frozenset[str]  # those of a plain float dtype (not float8, not packed integers)
    # a module's text-model name -> its name in the checkpoint, where they differ
    stored: Mapping[str, str] = field(default_factory=dict)

    @property
    def family(self) -> str:
        return self.scheme.family

    @property
    def method(self) -> str:
        return self.scheme.method

    @property
    def activations(self) -> str:
        return self.scheme.activations

    @property
    def block(self) -> tuple[int, int] | None:
        return self.scheme.block

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return self.scheme.tensor_names

    @property
    def optional_names(self) -> tuple[str, ...]:
        return self.scheme.optional_names

    def is_quantized(self, module: str) -> bool:
        stored = self.stored.get(module, module)
        if not (self.scheme.is_quantized(module) and self.scheme.is_quantized(stored)):
            return False
        if _named(self.scheme, module) or _named(self.scheme, stored):
            return True
        markers = set(self.tensor_names + self.optional_names) - _NOT_MARKERS
        if any(f"{module}.{m}" in self.names for m in markers):
            return True
        # a plain float weight and none of the format's tensors: stored plain. Else (a float8
        # weight without its scale, no weight at all): quantized, so that the format's reader
        # names the tensor it lacks
        return f"{module}.weight" not in self.plain

    def decode(self, tensors, out_features: int, in_features: int, where: str):
        return self.scheme.decode(tensors, out_features, in_features, where)

    def dummy(self, out_features: int, in_features: int, generator):
        return self.scheme.dummy(out_features, in_features, generator)

    def describe(self) -> str:
        return self.scheme.describe()


def bind_checkpoint(
    scheme: Any, source: str, text_name: Callable[[str], str | None] | None = None
) -> Any:
    """`scheme` bound to the tensor names of the checkpoint beside `source` (its config.json),
    renamed by `text_name` (None: as stored); `scheme` itself where no checkpoint is there (a
    config read alone, --load-format dummy)."""
    stored_dtypes = checkpoint_dtypes(Path(source).parent)
    if not stored_dtypes:
        return scheme
    dtypes: dict[str, str] = {}
    stored: dict[str, str] = {}
    for name, dtype in stored_dtypes.items():
        text = name if text_name is None else text_name(name)
        if text is None:
            continue  # a tensor of what batchrun does not run
        dtypes[text] = dtype
        if text != name:
            stored[text.rpartition(".")[0]] = name.rpartition(".")[0]
    plain = frozenset(name for name, dtype in dtypes.items() if dtype in PLAIN_DTYPES)
    return CheckpointScheme(scheme, frozenset(dtypes), plain, MappingProxyType(stored))


def checkpoint_dtypes(model_dir: Path) -> dict[str, str]:
    """Tensor name -> safetensors dtype ("BF16", "F8_E4M3", "I32", ...) of the checkpoint in
    `model_dir`, from the headers of its *.safetensors files (no tensor is read); empty
    without one."""
    dtypes: dict[str, str] = {}
    try:
        files = sorted(model_dir.glob("*.safetensors"))
    except OSError:
        return dtypes
    for path in files:
        dtypes.update(_header_dtypes(path))
    return dtypes


def _header_dtypes(path: Path) -> dict[str, str]:
    """A safetensors file's header (8 bytes of length, then JSON): name -> dtype."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error):
        return {}  # the loader reports a file it cannot read
    if not isinstance(header, dict):
        return {}
    tensors = {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
    return {k: str(v.get("dtype", "")) for k, v in tensors.items()}


def _named(scheme: Any, module: str) -> bool:
    """Whether one of the scheme's targets names `module` (its exact name or a "re:" pattern),
    rather than selecting it by class ("Linear") or selecting every linear (no targets)."""
    targets = getattr(scheme, "targets", None)
    if not isinstance(targets, ModuleFilter):
        return False
    named = tuple(p for p in targets.patterns if p != "Linear")
    return ModuleFilter(named, targets.dialect).matches(module)
