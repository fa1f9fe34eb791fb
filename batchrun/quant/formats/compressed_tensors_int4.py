"""compressed-tensors W4A16 checkpoints in the `pack-quantized` format (llm-compressor's W4A16
and W4A16_ASYM schemes): `quant_method: compressed-tensors`, `format: pack-quantized`, weights
`num_bits: 4`, `type: int`, strategy `group` or `channel`, activations unquantized.

The compressed-tensors dispatch (which format of the method a checkpoint holds) calls `parse`
for `format: pack-quantized`. Per linear with out_features N, in_features K, group size g
(G = K / g groups; 1 for strategy channel), as compressed-tensors 0.20.1 writes them:

    weight_packed      int32 [N, ceil(K / 8)]  eight input columns a word, in order
    weight_scale       bf16  [N, G]
    weight_shape       int   [2]               (N, K)
    weight_zero_point  int32 [ceil(N / 8), G]  symmetric: absent; else packed along N
    weight_g_idx       int32 [K]               actorder "group" only: the group of each column

    W[n, k] = (q[n, k] - zp[n, k // g]) * s[n, k // g]

q and zp are signed (-8..7) and stored plus 8 (0..15); unpacked values keep that offset on both,
which cancels in q - zp, and a symmetric zero point (0) is 8.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from batchrun.errors import ModelConfigError, WeightLoadError
from batchrun.quant.dummy import random_int4
from batchrun.quant.formats import int4_common as c
from batchrun.quant.formats.common import ModuleFilter, check_tensor, refuse, string_list
from batchrun.quant.weights import Int4Weight

METHOD = "compressed-tensors pack-quantized"
_LAYER = re.compile(r"^model\.layers\.\d+\.")
# actorder values that store weight_g_idx ("group", its alias "dynamic", and True in the
# compressed-tensors versions that wrote it); "weight" / "static" reorder only while quantizing
_G_IDX_ACTORDER = ("group", "dynamic", True)
INT32 = (torch.int32,)


@dataclass(frozen=True)
class PackQuantizedScheme:
    group_size: int  # -1: strategy channel, one group per row
    symmetric: bool
    has_g_idx: bool  # actorder "group"
    targets: ModuleFilter = ModuleFilter(("Linear",), "compressed-tensors")
    ignore: ModuleFilter = ModuleFilter((), "compressed-tensors")

    family: ClassVar[str] = "int4"
    method: ClassVar[str] = "compressed-tensors"
    activations: ClassVar[str] = "none"
    block: ClassVar[None] = None

    def describe(self) -> str:
        parts = ["compressed-tensors pack-quantized W4A16", c.describe_groups(self.group_size)]
        parts.append("symmetric" if self.symmetric else "zero points")
        if self.has_g_idx:
            parts.append("act-order")
        return f"int4 ({', '.join(parts)})"

    @property
    def tensor_names(self) -> tuple[str, ...]:
        names = ("weight_packed", "weight_scale")
        if not self.symmetric:
            names += ("weight_zero_point",)
        if self.has_g_idx:
            names += ("weight_g_idx",)
        return names

    @property
    def optional_names(self) -> tuple[str, ...]:
        return ("weight_shape",)

    def is_quantized(self, module: str) -> bool:
        """A decoder-layer linear that a target matches and no ignore entry does: "Linear" (the
        class) matches every linear, "re:<regex>" a name the regex matches from its start, any
        other entry only the module of that exact name (compressed-tensors' rules)."""
        if not _LAYER.match(module):
            return False
        return self.targets.matches(module) and not self.ignore.matches(module)

    def decode(
        self,
        tensors: Mapping[str, torch.Tensor],
        out_features: int,
        in_features: int,
        where: str,
    ) -> Int4Weight:
        n, k = out_features, in_features
        g = c.effective_group_size(k, self.group_size)
        c.require_divisible(where, "in_features", k, g, f"its group size is {g}")
        groups = k // g
        words_n, words_k = -(-n // c.PACK), -(-k // c.PACK)
        fmt = "compressed-tensors pack-quantized (weight_packed int32 [out, ceil(in / 8)], "
        fmt += f"weight_scale [out, {groups}], weight_zero_point int32 [ceil(out / 8), {groups}] "
        fmt += f"for in={k}, out={n})"
        packed = check_tensor(tensors, "weight_packed", where, ((n, words_k),), INT32, fmt)
        scales = check_tensor(tensors, "weight_scale", where, ((n, groups),), c.SCALE_DTYPES, fmt)
        if "weight_shape" in tensors:
            shape = check_tensor(tensors, "weight_shape", where, ((2,),), c.INT_DTYPES, fmt)
            if tuple(shape.tolist()) != (n, k):
                raise WeightLoadError(
                    f"tensor {where}.weight_shape holds {tuple(shape.tolist())}; expected "
                    f"({n}, {k}), the linear's [out, in] from config.json"
                )
        if self.symmetric:
            zeros = torch.full((n, groups), 8, dtype=torch.uint8, device=packed.device)
        else:
            zp = check_tensor(tensors, "weight_zero_point", where, ((words_n, groups),), INT32, fmt)
            # packed along N: [ceil(N / 8), G] -> [G, ceil(N / 8), 8] -> [G, N] -> [N, G]
            zeros = c.unpack_int4(zp.t()).flatten(-2)[:, :n].t().contiguous()
        g_idx = None
        if self.has_g_idx:
            g_idx = check_tensor(tensors, "weight_g_idx", where, ((k,),), c.INT_DTYPES, fmt)
            g_idx = c.check_g_idx(g_idx, groups, where, "weight_g_idx")
            if c.sequential_g_idx(g_idx, g):
                g_idx = None
        return Int4Weight(
            qweight=c.unpack_int4(packed).flatten(-2)[:, :k].contiguous(),
            scales=scales.contiguous(),
            zeros=zeros,
            group_size=g,
            g_idx=g_idx,
        )

    def dummy(self, out_features: int, in_features: int, generator: torch.Generator):
        return random_int4(out_features, in_features, self.group_size, generator, self.symmetric)


def parse(qcfg: Mapping[str, Any], source: str) -> PackQuantizedScheme:
    """The PackQuantizedScheme of a compressed-tensors quantization_config whose `format` is
    pack-quantized."""
    c.read_field(qcfg, ("quant_method",), source, METHOD, ("compressed-tensors",))
    # "mixed-precision" (or none): each config group names its own format
    top = c.read_field(
        qcfg, ("format",), source, METHOD, ("pack-quantized", "mixed-precision"), None
    )
    # "frozen" / "calibration": dense fake-quantized weights, not packed ones
    c.read_field(
        qcfg, ("quantization_status",), source, METHOD, ("compressed",), default="compressed"
    )
    sparsity = qcfg.get("sparsity_config") or {}
    if sparsity and str(sparsity.get("format", "dense")).lower() != "dense":
        raise refuse(source, "sparsity_config.format", sparsity.get("format"), "dense")
    if qcfg.get("transform_config"):
        raise ModelConfigError(
            f"{source}: quantization_config.transform_config is set (rotations applied to the "
            f"weights); batchrun reads {METHOD} checkpoints without transforms"
        )
    groups = qcfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelConfigError(
            f"{source}: quantization_config.config_groups is {groups!r}; expected a mapping of "
            "group names to schemes (targets, weights)"
        )
    weights, targets = None, []
    for name, group in groups.items():
        key = f"config_groups.{name}"
        if not isinstance(group, dict):
            raise ModelConfigError(
                f"{source}: quantization_config.{key} is {group!r}; expected a scheme "
                "(targets, weights, input_activations)"
            )
        default = "pack-quantized" if top == "pack-quantized" else c.REQUIRED
        c.read_field(group, ("format",), source, METHOD, ("pack-quantized",), default, f"{key}.")
        for acts in ("input_activations", "output_activations"):
            if group.get(acts) is not None:
                raise refuse(source, f"{key}.{acts}", group[acts], "null (W4A16)")
        args = _weight_args(group.get("weights"), source, f"{key}.weights.")
        if weights is not None and args != weights:
            raise ModelConfigError(
                f"{source}: quantization_config.config_groups quantize modules with different "
                f"weight schemes ({name}: {group.get('weights')}); batchrun reads {METHOD} "
                "checkpoints whose groups share one"
            )
        weights = args
        targets += string_list(group, "targets", source)
    ignore = string_list(qcfg, "ignore", source)
    group_size, symmetric, has_g_idx = weights
    return PackQuantizedScheme(
        group_size,
        symmetric,
        has_g_idx,
        ModuleFilter(tuple(targets), "compressed-tensors"),
        ModuleFilter(ignore, "compressed-tensors"),
    )


def _weight_args(w: Any, source: str, path: str) -> tuple[int, bool, bool]:
    """(group size, -1 for channel; symmetric; whether weight_g_idx is stored) of the weights
    at `path` ("config_groups.<name>.weights.")."""
    if not isinstance(w, dict):
        raise refuse(source, path.rstrip("."), w, "4-bit int weights (num_bits 4, type int)")

    def read(key: str, supported: tuple[Any, ...], default: Any, method: str = METHOD) -> Any:
        return c.read_field(w, (key,), source, method, supported, default, path)

    read("num_bits", (4,), 8)  # compressed-tensors' default is 8
    read("type", ("int",), "int")
    read("dynamic", (False,), False)
    read("block_structure", (None,), None)
    # compressed-tensors infers a missing strategy from the group size
    inferred = "channel" if w.get("group_size") == -1 else "group"
    strategy = read("strategy", ("group", "channel"), inferred)
    if strategy == "group":
        sizes = c.SUPPORTED_GROUP_SIZES
        group_size = read("group_size", sizes, c.REQUIRED, f"{METHOD}, strategy group")
    else:
        read("group_size", (None, -1), None, f"{METHOD}, strategy channel")
        group_size = -1
    symmetric = read("symmetric", (True, False), True)
    actorder = read("actorder", (None, False, "weight", "static", *_G_IDX_ACTORDER), None)
    return group_size, symmetric, actorder in _G_IDX_ACTORDER
