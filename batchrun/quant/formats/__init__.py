"""Quantized checkpoint formats: config.json's `quantization_config` -> a Scheme, which decodes a
linear's tensors into the one unpacked layout of batchrun/quant/weights.py.

    scheme = parse_quant_config(raw_config, "path/config.json")     # None: not quantized
    scheme.is_quantized("model.layers.3.self_attn.q_proj")          # False: ignored modules
    names = [f"{where}.{s}" for s in scheme.tensor_names]            # + those of optional_names
    qw = scheme.decode({suffix: tensor, ...}, out_features, in_features, where)

Each format is one module of this package with `parse(qcfg: dict, source: str) -> Scheme`,
listed in FORMATS under its `quant_method` (and, for compressed-tensors, its `format`): adding a
format is one line there and one module here. Only the decoder linears are quantized
(q/k/v/o_proj, gate/up/down_proj); embeddings and lm_head are read as plain weights.

Where the config selects linears by class (compressed-tensors' "Linear" target) or selects every
linear, the checkpoint's tensors decide which it holds quantized (checkpoint_targets.py: a
transformers-5 Qwen3-MoE holds its experts plain under a "Linear" target).

Errors: a config batchrun cannot run raises ModelConfigError naming the field, its value and
what is supported; a tensor that does not match its format raises WeightLoadError naming the
tensor, its shape and dtype, and the shape expected.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from batchrun.errors import ModelConfigError
from batchrun.quant.formats.checkpoint_targets import bind_checkpoint

if TYPE_CHECKING:
    import torch

    from batchrun.quant.weights import QuantizedWeight

# (quant_method, compressed-tensors `format` or None) -> the module of this package that parses
# it, and what the format is, for messages
FORMATS: dict[tuple[str, str | None], tuple[str, str]] = {
    ("compressed-tensors", "float-quantized"): ("compressed_tensors_fp8", "FP8"),
    ("compressed-tensors", "naive-quantized"): ("compressed_tensors_fp8", "FP8"),
    ("compressed-tensors", "pack-quantized"): ("compressed_tensors_int4", "INT4 W4A16"),
    ("modelopt", None): ("modelopt", "FP8"),
    ("fp8", None): ("fp8", "FP8, 128x128 blocks or per tensor"),
    ("awq", None): ("awq", "INT4, GEMM layout"),
    ("gptq", None): ("gptq", "INT4"),
}
FAMILIES = ("fp8", "int4")
# what a quantized linear's activations are: "none" (weight-only), "dynamic" (quantized per
# token at run time; per token and group of block[1] columns with FP8 blocks), "static" (one
# per-tensor scale from the checkpoint, `input_scale`)
ACTIVATIONS = ("none", "dynamic", "static")


class Scheme(Protocol):
    """What a format's parse() returns: a frozen description of how every quantized linear of
    the checkpoint is stored, and its decoder."""

    family: str  # one of FAMILIES
    method: str  # config.json's quant_method
    activations: str  # one of ACTIVATIONS ("none" for the INT4 formats)
    block: tuple[int, int] | None  # FP8 weight blocks (rows, columns); None otherwise

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """The suffixes every quantized linear has, e.g. ("qweight", "qzeros", "scales")."""
        ...

    @property
    def optional_names(self) -> tuple[str, ...]:
        """The suffixes a quantized linear may have, e.g. ("g_idx",)."""
        ...

    def is_quantized(self, module: str) -> bool:
        """Whether the linear `module` (a checkpoint name prefix such as
        "model.layers.3.mlp.down_proj") is stored in this format; False for ignored ones."""
        ...

    def decode(
        self, tensors: dict[str, torch.Tensor], out_features: int, in_features: int, where: str
    ) -> QuantizedWeight:
        """The linear `where` ([out_features, in_features] in the full, TP=1 model) from its
        tensors (suffix -> tensor: tensor_names and the optional_names it has), in the
        unpacked layout; WeightLoadError naming the tensor when one does not match."""
        ...

    def dummy(self, out_features: int, in_features: int, generator: torch.Generator) -> Any:
        """A random weight of this scheme's shape (blocks, groups; no g_idx), drawn on the
        generator's device (batchrun/quant/dummy.py has the helpers)."""
        ...

    def describe(self) -> str:
        """One line for the start-up log and `plan`, e.g. "fp8 (compressed-tensors, per-channel
        weights, dynamic per-token activations)"."""
        ...


def parse_quant_config(
    raw_config: dict[str, Any], source: str, text_name: Callable[[str], str | None] | None = None
) -> Scheme | None:
    """The Scheme of a config.json (as a dict) read from `source`; None without a
    quantization_config. ModelConfigError for a method, format or setting batchrun does not
    run, naming the field and listing what is supported. `text_name`: a checkpoint tensor's
    name in the text model (a multimodal checkpoint's; None: the tensor is not run), so that
    the scheme answers for text-model names (checkpoint_targets.py)."""
    qcfg = raw_config.get("quantization_config")
    if qcfg is None:
        return None
    if not isinstance(qcfg, dict):
        raise ModelConfigError(
            f"{source}: quantization_config is {type(qcfg).__name__}, not an object"
        )
    method = qcfg.get("quant_method")
    methods = sorted({m for m, _ in FORMATS})
    if method not in methods:
        raise ModelConfigError(
            f"{source}: quantization_config.quant_method {method!r} is not supported; "
            f"supported: {supported_formats()}"
        )
    fmt = compressed_tensors_format(qcfg, source) if method == "compressed-tensors" else None
    module_name, _ = FORMATS[(method, fmt)]
    full_name = f"{__name__}.{module_name}"
    try:
        module = importlib.import_module(full_name)
    except ModuleNotFoundError as e:
        if e.name != full_name:
            raise
        raise ModelConfigError(
            f"{source}: quantization_config.quant_method {method!r}"
            f"{f' (format {fmt!r})' if fmt else ''} is a format batchrun reads, but its reader "
            f"({full_name}) is missing from this installation; reinstall batchrun"
        ) from None
    # where the config selects linears by class, the checkpoint's tensors say which it holds
    return bind_checkpoint(module.parse(qcfg, source), source, text_name)


def supported_formats() -> str:
    """The supported quant_method values (and compressed-tensors formats), for messages."""
    parts = []
    for (method, fmt), (_, what) in FORMATS.items():
        parts.append(f"{method} ({f'format {fmt}: ' if fmt else ''}{what})")
    return ", ".join(parts)


def compressed_tensors_format(qcfg: dict[str, Any], source: str) -> str:
    """The compressed-tensors `format` of a checkpoint: the top-level one, or with
    "mixed-precision" (or none) the one every config group names."""
    fmt = qcfg.get("format")
    if fmt is None or fmt == "mixed-precision":
        groups = qcfg.get("config_groups") or {}
        found = {g.get("format") for g in groups.values() if isinstance(g, dict)}
        if len(found) > 1:
            raise ModelConfigError(
                f"{source}: quantization_config.config_groups mix the formats "
                f"{sorted(map(str, found))}; batchrun runs one format per model"
            )
        fmt = found.pop() if found else fmt
    supported = [f for m, f in FORMATS if m == "compressed-tensors"]
    if fmt not in supported:
        raise ModelConfigError(
            f"{source}: quantization_config.format {fmt!r} (compressed-tensors) is not "
            f"supported; supported: {', '.join(supported)}"
        )
    return fmt
