"""GPTQ INT4 checkpoints (AutoGPTQ, GPTQModel, optimum, llm-compressor's GPTQ export):
`quant_method: gptq`, `bits: 4`, symmetric or not, with or without act-order (`desc_act`).

Per linear with out_features N, in_features K, group size g (G = ceil(K / g) groups):

    qweight  int32 [K / 8, N]   eight input rows per word: nibble i of word r is row 8r + i
    qzeros   int32 [G, N / 8]   eight output columns per word, in order
    scales   fp16  [G, N]
    g_idx    int32 [K]          the group of each input row

    W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]

`checkpoint_format` "gptq" (v1, what AutoGPTQ and most published checkpoints hold) stores each
zero point minus one, so z = stored + 1 (1..16); "gptq_v2" (GPTQModel) stores z itself. Without
desc_act, g_idx[k] = k // g; with it, act-order quantized the rows in another order and g_idx
names each row's group.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from batchrun.errors import ModelConfigError
from batchrun.quant.dummy import random_int4
from batchrun.quant.formats import int4_common as c
from batchrun.quant.formats.common import check_tensor
from batchrun.quant.weights import Int4Weight

METHOD = "GPTQ"
_LAYER = re.compile(r"^model\.layers\.\d+\.")


@dataclass(frozen=True)
class GptqScheme:
    group_size: int  # -1: one group per row
    desc_act: bool
    sym: bool
    zero_minus_one: bool  # checkpoint_format "gptq" (v1)
    # modules_in_block_to_quantize, flattened ("self_attn.q_proj", ...); empty: every linear
    block_modules: tuple[str, ...] = ()
    # patterns of GPTQModel's `dynamic` rules that leave a module unquantized ("-:" rules)
    skip_patterns: tuple[str, ...] = ()

    family: ClassVar[str] = "int4"
    method: ClassVar[str] = "gptq"
    activations: ClassVar[str] = "none"
    block: ClassVar[None] = None
    tensor_names: ClassVar[tuple[str, ...]] = ("qweight", "qzeros", "scales")
    optional_names: ClassVar[tuple[str, ...]] = ("g_idx",)

    def describe(self) -> str:
        version = "v1" if self.zero_minus_one else "v2"
        parts = [f"GPTQ {version}", c.describe_groups(self.group_size)]
        parts.append("symmetric" if self.sym else "zero points")
        if self.desc_act:
            parts.append("act-order")
        return f"int4 ({', '.join(parts)})"

    def is_quantized(self, module: str) -> bool:
        if not _LAYER.match(module):
            return False
        if any(re.match(p, module) for p in self.skip_patterns):
            return False
        return not self.block_modules or _LAYER.sub("", module) in self.block_modules

    def decode(
        self,
        tensors: Mapping[str, torch.Tensor],
        out_features: int,
        in_features: int,
        where: str,
    ) -> Int4Weight:
        n, k = out_features, in_features
        c.require_divisible(where, "in_features", k, c.PACK, "GPTQ packs 8 input rows a word")
        c.require_divisible(
            where, "out_features", n, c.PACK, "GPTQ packs the zero points of 8 columns a word"
        )
        g = c.effective_group_size(k, self.group_size)
        groups = c.num_groups(k, g)
        fmt = "GPTQ (qweight int32 [in / 8, out], qzeros int32 [groups, out / 8], scales "
        fmt += f"[groups, out], g_idx int32 [in] for in={k}, out={n}, {groups} groups of {g})"
        int32 = (torch.int32,)
        qweight = check_tensor(tensors, "qweight", where, ((k // c.PACK, n),), int32, fmt)
        qzeros = check_tensor(tensors, "qzeros", where, ((groups, n // c.PACK),), int32, fmt)
        scales = check_tensor(tensors, "scales", where, ((groups, n),), c.SCALE_DTYPES, fmt)
        g_idx = None
        if self.desc_act or "g_idx" in tensors:
            g_idx = check_tensor(tensors, "g_idx", where, ((k,),), c.INT_DTYPES, fmt)
            g_idx = c.check_g_idx(g_idx, groups, where, "g_idx")
            if c.sequential_g_idx(g_idx, g):
                g_idx = None  # the rows in order: no lookup needed, and TP slices by group
        # [K / 8, N, 8] -> [K / 8, 8, N] -> [K, N]: row 8r + i is nibble i of word row r
        q = c.unpack_int4(qweight).transpose(1, 2).reshape(k, n)
        zeros = c.unpack_int4(qzeros).flatten(-2)  # [G, N]
        if self.zero_minus_one:
            zeros += 1
        return Int4Weight(
            qweight=q.t().contiguous(),
            scales=scales.t().contiguous(),
            zeros=zeros.t().contiguous(),
            group_size=g,
            g_idx=g_idx,
        )

    def dummy(self, out_features: int, in_features: int, generator: torch.Generator):
        return random_int4(out_features, in_features, self.group_size, generator, self.sym)


def parse(qcfg: Mapping[str, Any], source: str) -> GptqScheme:
    """The GptqScheme of config.json's quantization_config (quant_method "gptq")."""
    c.read_field(qcfg, ("quant_method",), source, METHOD, ("gptq",))
    bits = c.read_field(qcfg, ("bits",), source, METHOD, (4,))
    group_size = c.read_group_size(qcfg, ("group_size",), source, METHOD, True)
    desc_act = c.read_field(qcfg, ("desc_act",), source, METHOD, (False, True), default=False)
    sym = c.read_field(qcfg, ("sym",), source, METHOD, (True, False), default=True)
    # transformers writes checkpoint_format, GPTQModel format; "marlin", "bitblas", ... repack
    fmt = c.read_field(
        qcfg, ("checkpoint_format", "format"), source, METHOD, ("gptq", "gptq_v2"), default="gptq"
    )
    c.read_field(qcfg, ("pack_dtype",), source, METHOD, ("int32",), default="int32")
    c.read_field(qcfg, ("is_marlin_format",), source, METHOD, (False,), default=False)
    # a quantized lm_head (GPTQModel's lm_head: true) is not among the layers batchrun reads
    c.read_field(qcfg, ("lm_head",), source, METHOD, (False,), default=False)
    block = qcfg.get("modules_in_block_to_quantize") or ()
    if not isinstance(block, list | tuple) or not all(
        isinstance(part, list | tuple) and all(isinstance(m, str) for m in part) for part in block
    ):
        raise ModelConfigError(
            f"{source}: quantization_config.modules_in_block_to_quantize is {block!r}; expected "
            'lists of module names, e.g. [["self_attn.q_proj", "self_attn.k_proj"]]'
        )
    base = {"bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym}
    skip = _dynamic_skips(qcfg.get("dynamic") or {}, base, source)
    return GptqScheme(
        group_size=group_size,
        desc_act=desc_act,
        sym=sym,
        zero_minus_one=fmt == "gptq",
        block_modules=tuple(m for part in block for m in part),
        skip_patterns=skip,
    )


def _dynamic_skips(dynamic: Any, base: dict[str, Any], source: str) -> tuple[str, ...]:
    """GPTQModel's per-module rules: "-:regex" leaves the modules it matches unquantized;
    "+:regex" (or a bare regex) overrides bits / group_size / ... for them, which batchrun
    accepts only where the override restates the checkpoint's own values."""
    if not isinstance(dynamic, dict):
        raise ModelConfigError(
            f"{source}: quantization_config.dynamic is {dynamic!r}; expected a mapping of "
            "module patterns to overrides"
        )
    skips = []
    for pattern, override in dynamic.items():
        if pattern.startswith("-:"):
            skips.append(pattern.removeprefix("-:"))
            continue
        changed = {
            key: value
            for key, value in (override or {}).items()
            if key in base and value != base[key]
        }
        if changed:
            raise ModelConfigError(
                f"{source}: quantization_config.dynamic[{pattern!r}] sets {changed} for some "
                f"modules; batchrun reads GPTQ checkpoints whose quantized modules all share "
                f'one scheme ({base}); rules that leave modules unquantized ("-:") are supported'
            )
    return tuple(skips)
