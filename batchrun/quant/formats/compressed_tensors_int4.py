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
from batchrun.quant.formats import int4_common as c
from batchrun.quant.weights import Int4Weight

METHOD = "compressed-tensors pack-quantized"
_LAYER = re.compile(r"^model\.layers\.\d+\.")
# actorder values that store weight_g_idx ("group", its alias "dynamic", and True in the
# compressed-tensors versions that wrote it); "weight" / "static" reorder only while quantizing
_G_IDX_ACTORDER = ("group", "dynamic", True)


@dataclass(frozen=True)
class PackQuantizedScheme:
    group_size: int  # -1: strategy channel, one group per row
    symmetric: bool
    has_g_idx: bool  # actorder "group"
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()

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
        return match_module(module, self.targets) and not match_module(module, self.ignore)

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
        layout = "pack-quantized: weight_packed int32 [out, ceil(in / 8)], weight_scale "
        layout += f"[out, {groups}], weight_zero_point int32 [ceil(out / 8), {groups}] for "
        layout += f"in={k}, out={n}"
        packed = c.take(tensors, "weight_packed", where, (n, words_k), (torch.int32,), layout)
        scales = c.take(tensors, "weight_scale", where, (n, groups), c.SCALE_DTYPES, layout)
        if "weight_shape" in tensors:
            shape = c.take(tensors, "weight_shape", where, (2,), c.INT_DTYPES, layout)
            if tuple(shape.tolist()) != (n, k):
                raise WeightLoadError(
                    f"tensor {where}.weight_shape holds {tuple(shape.tolist())}; expected "
                    f"({n}, {k}), the linear's [out, in] from config.json"
                )
        if self.symmetric:
            zeros = torch.full((n, groups), 8, dtype=torch.uint8, device=packed.device)
        else:
            zp = c.take(
                tensors, "weight_zero_point", where, (words_n, groups), (torch.int32,), layout
            )
            # packed along N: [ceil(N / 8), G] -> [G, ceil(N / 8), 8] -> [G, N] -> [N, G]
            zeros = c.unpack_int4(zp.t()).flatten(-2)[:, :n].t().contiguous()
        g_idx = None
        if self.has_g_idx:
            g_idx = c.take(tensors, "weight_g_idx", where, (k,), c.INT_DTYPES, layout)
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
        return c.random_int4(
            out_features, in_features, self.group_size, self.symmetric, torch.bfloat16, generator
        )


def match_module(module: str, entries: tuple[str, ...]) -> bool:
    for entry in entries:
        if entry == "Linear" or entry == module:
            return True
        if entry.startswith("re:") and re.match(entry.removeprefix("re:"), module):
            return True
    return False


def parse(qcfg: Mapping[str, Any], source: str) -> PackQuantizedScheme:
    """The PackQuantizedScheme of a compressed-tensors quantization_config whose `format` is
    pack-quantized."""
    c.read_field(qcfg, ("quant_method",), source, METHOD, ("compressed-tensors",))
    c.read_field(qcfg, ("format",), source, METHOD, ("pack-quantized",))
    # "frozen" / "calibration": dense fake-quantized weights, not packed ones
    c.read_field(
        qcfg, ("quantization_status",), source, METHOD, ("compressed",), default="compressed"
    )
    sparsity = qcfg.get("sparsity_config") or {}
    if sparsity and str(sparsity.get("format", "dense")).lower() != "dense":
        c.config_error(source, "sparsity_config.format", sparsity.get("format"), METHOD, "dense")
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
        c.read_field(group, ("format",), source, METHOD, ("pack-quantized", None), None, f"{key}.")
        for acts in ("input_activations", "output_activations"):
            if group.get(acts) is not None:
                c.config_error(source, f"{key}.{acts}", group[acts], METHOD, "null (W4A16)")
        args = _weight_args(group.get("weights"), source, f"{key}.weights.")
        if weights is not None and args != weights:
            raise ModelConfigError(
                f"{source}: quantization_config.config_groups quantize modules with different "
                f"weight schemes ({name}: {group.get('weights')}); batchrun reads {METHOD} "
                "checkpoints whose groups share one"
            )
        weights = args
        group_targets = group.get("targets")
        if not isinstance(group_targets, list) or not all(
            isinstance(t, str) for t in group_targets
        ):
            raise ModelConfigError(
                f"{source}: quantization_config.{key}.targets is {group_targets!r}; expected a "
                'list of module names, classes ("Linear") or "re:" patterns'
            )
        targets += group_targets
    ignore = qcfg.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise ModelConfigError(
            f"{source}: quantization_config.ignore is {ignore!r}; expected a list of module "
            'names or "re:" patterns'
        )
    group_size, symmetric, has_g_idx = weights
    return PackQuantizedScheme(group_size, symmetric, has_g_idx, tuple(targets), tuple(ignore))


def _weight_args(w: Any, source: str, path: str) -> tuple[int, bool, bool]:
    """(group size, -1 for channel; symmetric; whether weight_g_idx is stored) of the weights
    at `path` ("config_groups.<name>.weights.")."""
    if not isinstance(w, dict):
        c.config_error(source, path.rstrip("."), w, METHOD, "4-bit int weights")

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
        group_size = read("group_size", sizes, c.REQUIRED, f"{METHOD} group-strategy")
    else:
        read("group_size", (None, -1), None, f"{METHOD} channel-strategy")
        group_size = -1
    symmetric = read("symmetric", (True, False), True)
    actorder = read("actorder", (None, False, "weight", "static", *_G_IDX_ACTORDER), None)
    return group_size, symmetric, actorder in _G_IDX_ACTORDER
