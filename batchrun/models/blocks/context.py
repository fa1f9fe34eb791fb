"""BuildContext: what every block is built with, in one frozen object."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from batchrun.config import KernelPlan
from batchrun.layers.norm import RMSNorm
from batchrun.models.config import ModelConfig
from batchrun.parallel.partition import TPPartition
from batchrun.parallel.state import TPGroup
from batchrun.quant.linear import plan_linear


@dataclass(frozen=True)
class BuildContext:
    cfg: ModelConfig
    dtype: torch.dtype
    device: torch.device | str
    kernels: KernelPlan
    tp: TPGroup  # the tensor-parallel group (TPGroup(): TP=1)
    part: TPPartition  # this rank's share of the model
    max_positions: int  # the longest context the rotary tables cover

    def norm(self, dim: int | None = None) -> RMSNorm:
        """An RMSNorm over `dim` (the hidden size by default) with the model's eps."""
        dim = self.cfg.hidden_size if dim is None else dim
        return RMSNorm(dim, self.cfg.rms_norm_eps, self.dtype, self.device, self.kernels)

    def quant_plan(self, names: tuple[str, ...], rows: int, cols: int):
        """How checkpoint linears `names`, fused into [rows, cols], are quantized (None:
        plain weights)."""
        plan = partial(
            plan_linear,
            self.cfg.quantization,
            self.kernels.fp8_matmul,
            self.dtype,
            int4_matmul=self.kernels.int4_matmul,
        )
        return plan(names, rows, cols)
