"""Linear layers, tensor-parallel. Each holds only this rank's slice of its weight and says,
through `param_shards()`, which slice of the full (TP=1) tensor that is, so the loaders fill it
from a checkpoint or from full-size random weights. At TP=1 the slice is the whole tensor and the
collectives are no-ops: these are then plain Linear / Embedding layers.

    ColumnParallelLinear   y[:, local outputs] = x @ W[local rows]^T     no communication
    RowParallelLinear      y = all_reduce(x[:, local inputs] @ W[:, local cols]^T) + b
    VocabParallelEmbedding e = all_reduce(local rows of the table, zero for other ranks' ids)

A column-parallel layer feeding a row-parallel one (qkv -> attention -> o_proj, gate_up -> down)
costs one all-reduce per pair.

A layer built with a QuantSpec holds a quantized weight instead of `weight`: a QuantMatmul
(batchrun/quant/linear.py) the loader fills through `load_quantized`; its bias stays a plain
parameter. Its decode batches run on kernels/fp8_gemv.py where decode_gemv is "triton" and the
layer keeps its FP8 weight (scaled_mm).

The matmuls of decode batches (at most GEMV_MAX_ROWS rows, bf16 / fp16, no bias) run on
kernels/gemv.py where the kernel plan's decode_gemv is "triton", else on cuBLAS (F.linear).
NOTE: the kernel beats cuBLAS at M = 1 on the llama matrices, and W3 with it (docs/benchmarks.md,
Kernels: Decode GEMV).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.config import KernelPlan
from batchrun.parallel.partition import ShardSpec
from batchrun.parallel.state import TPGroup
from batchrun.quant.linear import QuantMatmul, QuantSpec
from batchrun.quant.weights import QuantizedWeight

try:
    from batchrun.kernels.gemv import gemv, gemv_residual
except ImportError:  # no Triton (CPU-only installs): KernelPlan.decode_gemv is "cublas"
    gemv = gemv_residual = None

GEMV_MAX_ROWS = 16  # kernels/gemv.py's MAX_M


def takes_gemv(x: torch.Tensor, bias: torch.Tensor | None, kernels: KernelPlan) -> bool:
    """Whether x @ w.T runs on kernels/gemv.py: a decode-sized x ([M, K], M <= GEMV_MAX_ROWS,
    unit stride along K, bf16 / fp16), no bias, decode_gemv "triton"."""
    return (
        kernels.decode_gemv == "triton"
        and bias is None
        and x.dim() == 2
        and x.shape[0] <= GEMV_MAX_ROWS
        and x.stride(-1) == 1
        and x.dtype in (torch.float16, torch.bfloat16)
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    kernels: KernelPlan | None = None,
) -> torch.Tensor:
    """F.linear, or kernels/gemv.py where `takes_gemv`."""
    if kernels is not None and takes_gemv(x, bias, kernels):
        return gemv(x, weight, pdl=kernels.pdl)
    return F.linear(x, weight, bias)


def takes_decode_norms(layer: ColumnParallelLinear | RowParallelLinear) -> bool:
    """Whether the layer's one-row decode matmul adds the residual and normalizes the sum in its
    epilogue (`decode_gemv_residual`): a plain weight (kernels/gemv.py), without a bias, on one
    rank."""
    parallel = isinstance(layer, RowParallelLinear) and layer.tp.is_parallel
    return layer.quant is None and layer.bias is None and not parallel


def decode_gemv(
    layer: ColumnParallelLinear | RowParallelLinear, x: torch.Tensor, swiglu: bool = False
) -> torch.Tensor:
    """The layer's matmul of a decode batch on its GEMV kernel (kernels/gemv.py, or the
    quantized weight's: QuantMatmul.gemv); with swiglu, of a fused gate_up, silu(gate) * up."""
    if layer.quant is not None:
        return layer.quant.gemv(x, swiglu)
    return gemv(x, layer.weight, swiglu=swiglu, pdl=layer.kernels.pdl)


def decode_gemv_residual(
    layer: ColumnParallelLinear | RowParallelLinear,
    x: torch.Tensor,
    residual: torch.Tensor,
    norm: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h, normed): h = the layer's matmul of x plus residual, and with norm (one row) normed =
    rmsnorm(h) times its weight, inside the matmul's kernel (`takes_decode_norms`)."""
    return gemv_residual(x, layer.weight, residual, norm=norm, pdl=layer.kernels.pdl)


class ColumnParallelLinear(nn.Module):
    """Output features split by `spec` (dim 0; several runs for fused projections). The local
    weight may be longer than the spec's runs (vocab padding); those rows stay zero."""

    def __init__(
        self,
        in_features: int,
        spec: ShardSpec,
        local_rows: int,
        bias: bool,
        dtype,
        device,
        kernels: KernelPlan | None = None,
        quant: QuantSpec | None = None,
    ):
        super().__init__()
        assert spec.dim == 0
        self.spec = spec
        self.kernels = kernels or KernelPlan.reference()
        if quant is None:
            self.weight = nn.Parameter(
                torch.empty(local_rows, in_features, dtype=dtype, device=device)
            )
            self.quant = None
        else:
            self.weight = None
            self.quant = QuantMatmul(
                local_rows, in_features, quant, dtype, device, kernels=self.kernels
            )
        self.bias = (
            nn.Parameter(torch.empty(local_rows, dtype=dtype, device=device)) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            y = self.quant(x)
            return y if self.bias is None else y + self.bias
        return linear(x, self.weight, self.bias, self.kernels)

    def load_quantized(self, qw: QuantizedWeight, where: str) -> None:
        self.quant.load(qw, where)

    def param_shards(self) -> dict[str, ShardSpec]:
        specs = {} if self.quant is not None else {"weight": self.spec}
        if self.bias is not None:
            specs["bias"] = self.spec
        return specs


class RowParallelLinear(nn.Module):
    """Input features split by `spec` (dim 1); partial products are summed across ranks. The
    bias is replicated and added once, after the sum."""

    def __init__(
        self,
        spec: ShardSpec,
        out_features: int,
        bias: bool,
        tp: TPGroup,
        dtype,
        device,
        kernels: KernelPlan | None = None,
        quant: QuantSpec | None = None,
        columns_tp: TPGroup | None = None,
    ):
        """columns_tp: the ranks that hold the input's other columns, where `tp` (the sum's
        group) is TPGroup() because a later all-reduce sums the partial products (a shared
        expert's); by default `tp`."""
        super().__init__()
        assert spec.dim == 1
        self.spec, self.tp = spec, tp
        columns_tp = tp if columns_tp is None else columns_tp
        self.kernels = kernels or KernelPlan.reference()
        if quant is None:
            self.weight = nn.Parameter(
                torch.empty(out_features, spec.local_len, dtype=dtype, device=device)
            )
            self.quant = None
        else:
            self.weight = None
            reduce_max = columns_tp.all_reduce_max if columns_tp.is_parallel else None
            self.quant = QuantMatmul(
                out_features, spec.local_len, quant, dtype, device, reduce_max, self.kernels
            )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            y = self.tp.all_reduce(self.quant(x))
            return y if self.bias is None else y + self.bias
        if not self.tp.is_parallel:
            return linear(x, self.weight, self.bias, self.kernels)
        y = self.tp.all_reduce(linear(x, self.weight, kernels=self.kernels))
        return y if self.bias is None else y + self.bias

    def load_quantized(self, qw: QuantizedWeight, where: str) -> None:
        self.quant.load(qw, where)

    def param_shards(self) -> dict[str, ShardSpec]:
        return {} if self.quant is not None else {"weight": self.spec}


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_start + local rows) of the table; ids of other ranks look up
    zeros here, and the all-reduce fills them in from their owners."""

    def __init__(self, spec: ShardSpec, local_rows: int, dim: int, tp: TPGroup, dtype, device):
        super().__init__()
        self.spec, self.tp = spec, tp
        self.vocab_start = spec.runs[0].full_start if spec.runs else 0
        self.num_local = spec.local_len
        self.weight = nn.Parameter(torch.empty(local_rows, dim, dtype=dtype, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)  # [T]
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)

    def param_shards(self) -> dict[str, ShardSpec]:
        return {"weight": self.spec}
