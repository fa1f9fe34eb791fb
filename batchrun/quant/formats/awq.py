"""AWQ INT4 checkpoints in the GEMM layout (AutoAWQ, GPTQModel's AWQ, llm-compressor's AWQ
export to this format): `quant_method: awq`, `version` (or `format`) "gemm", `bits: 4`.

Per linear with out_features N, in_features K, group size g:

    qweight  int32 [K, N / 8]      eight output columns per word, interleaved
    qzeros   int32 [K / g, N / 8]  the zero points, packed like qweight
    scales   fp16  [K / g, N]

    W[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n]

The interleave: nibble i of word c holds column 8c + AWQ_ORDER[i], the order AWQ's GEMM kernel
dequantizes in (AWQ_ORDER = 0, 2, 4, 6, 1, 3, 5, 7; its inverse, which nibble holds column
8c + j, is AWQ_REVERSE_ORDER).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from batchrun.errors import ModelConfigError
from batchrun.quant.dummy import random_int4
from batchrun.quant.formats import int4_common as c
from batchrun.quant.formats.common import ModuleFilter, check_tensor, string_list
from batchrun.quant.weights import Int4Weight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
METHOD = "AWQ"


@dataclass(frozen=True)
class AwqScheme:
    group_size: int  # -1: one group per row
    zero_point: bool
    modules_to_not_convert: ModuleFilter = ModuleFilter()  # substrings of module names

    family: ClassVar[str] = "int4"
    method: ClassVar[str] = "awq"
    activations: ClassVar[str] = "none"
    block: ClassVar[None] = None
    tensor_names: ClassVar[tuple[str, ...]] = ("qweight", "qzeros", "scales")
    optional_names: ClassVar[tuple[str, ...]] = ()

    def describe(self) -> str:
        return f"int4 (AWQ GEMM, {c.describe_groups(self.group_size)}, zero points)"

    def is_quantized(self, module: str) -> bool:
        """AutoAWQ quantizes every linear of the decoder layers but those whose name contains
        an entry of modules_to_not_convert (a substring match, as transformers and vLLM do)."""
        if not module.startswith("model.layers."):
            return False
        return not self.modules_to_not_convert.matches(module)

    def decode(
        self,
        tensors: Mapping[str, torch.Tensor],
        out_features: int,
        in_features: int,
        where: str,
    ) -> Int4Weight:
        n, k = out_features, in_features
        c.require_divisible(where, "out_features", n, c.PACK, "AWQ packs 8 output columns a word")
        g = c.effective_group_size(k, self.group_size)
        c.require_divisible(where, "in_features", k, g, f"AWQ's group size is {g}")
        groups = k // g
        fmt = f"AWQ GEMM (qweight int32 [in, out / 8], qzeros int32 [in / {g}, out / 8], "
        fmt += f"scales [in / {g}, out] for in={k}, out={n})"
        int32 = (torch.int32,)
        qweight = check_tensor(tensors, "qweight", where, ((k, n // c.PACK),), int32, fmt)
        qzeros = check_tensor(tensors, "qzeros", where, ((groups, n // c.PACK),), int32, fmt)
        scales = check_tensor(tensors, "scales", where, ((groups, n),), c.SCALE_DTYPES, fmt)
        return Int4Weight(
            qweight=unpack_awq(qweight).t().contiguous(),
            scales=scales.t().contiguous(),
            zeros=unpack_awq(qzeros).t().contiguous(),
            group_size=g,
        )

    def dummy(self, out_features: int, in_features: int, generator: torch.Generator):
        return random_int4(out_features, in_features, self.group_size, generator, symmetric=False)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] in AWQ's interleaved order -> uint8 [R, C], column j in place j."""
    nibbles = c.unpack_int4(packed)  # [R, C / 8, 8], nibble order
    reverse = torch.tensor(AWQ_REVERSE_ORDER, device=packed.device)
    return nibbles.index_select(-1, reverse).flatten(-2)


def parse(qcfg: Mapping[str, Any], source: str) -> AwqScheme:
    """The AwqScheme of config.json's quantization_config (quant_method "awq")."""
    c.read_field(qcfg, ("quant_method",), source, METHOD, ("awq",))
    # NOTE: transformers writes `version`, GPTQModel `format`; both default to the GEMM layout.
    # GEMV, GEMV_fast, Marlin, ExLlama and IPEX checkpoints pack differently.
    c.read_field(qcfg, ("version", "format"), source, METHOD, ("gemm",), default="gemm")
    # `backend` names the kernels that run a checkpoint, but "llm-awq" MIT's own packing
    if str(qcfg.get("backend", "")).lower() == "llm-awq":
        raise ModelConfigError(
            f"{source}: quantization_config.backend 'llm-awq' is not supported (a packing for "
            "llm-awq's own kernels); supported: AWQ checkpoints in the GEMM layout (version gemm)"
        )
    c.read_field(qcfg, ("bits", "w_bit"), source, METHOD, (4,))
    group_size = c.read_group_size(qcfg, ("group_size", "q_group_size"), source, METHOD, True)
    # NOTE: GEMM checkpoints carry qzeros whatever zero_point says (AutoAWQ writes only
    # zero_point: true; GPTQModel's AWQ packs qzeros for a symmetric one too), and batchrun
    # reads them as stored, as vLLM does
    zero_point = c.read_field(qcfg, ("zero_point",), source, METHOD, (True, False), default=True)
    skip = string_list(qcfg, "modules_to_not_convert", source)
    return AwqScheme(group_size, zero_point, ModuleFilter(skip, "substring"))
