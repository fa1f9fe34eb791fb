"""Tensor-parallel layers. Each holds only this rank's slice of its weight and says, through
`param_shards()`, which slice of the full (TP=1) tensor that is, so the loaders fill it from a
checkpoint or from full-size random weights. At TP=1 the slice is the whole tensor and the
collectives are no-ops: these are then plain Linear / Embedding layers.

    ColumnParallelLinear   y[:, local outputs] = x @ W[local rows]^T     no communication
    RowParallelLinear      y = all_reduce(x[:, local inputs] @ W[:, local cols]^T) + b
    VocabParallelEmbedding e = all_reduce(local rows of the table, zero for other ranks' ids)

A column-parallel layer feeding a row-parallel one (qkv -> attention -> o_proj, gate_up -> down)
costs one all-reduce per pair.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.models.layers import linear
from batchrun.parallel.partition import ShardSpec
from batchrun.parallel.state import TPGroup


class ColumnParallelLinear(nn.Module):
    """Output features split by `spec` (dim 0; several runs for fused projections). The local
    weight may be longer than the spec's runs (vocab padding); those rows stay zero."""

    # the default mode of the Triton decode matmuls (models.layers.linear); the model runner
    # sets it per model (LlamaForCausalLM.set_decode_gemv)
    decode_gemv: str | None = None

    def __init__(
        self, in_features: int, spec: ShardSpec, local_rows: int, bias: bool, dtype, device
    ):
        super().__init__()
        assert spec.dim == 0
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(local_rows, in_features, dtype=dtype, device=device))
        self.bias = (
            nn.Parameter(torch.empty(local_rows, dtype=dtype, device=device)) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.decode_gemv)

    def param_shards(self) -> dict[str, ShardSpec]:
        specs = {"weight": self.spec}
        if self.bias is not None:
            specs["bias"] = self.spec
        return specs


class RowParallelLinear(nn.Module):
    """Input features split by `spec` (dim 1); partial products are summed across ranks. The
    bias is replicated and added once, after the sum."""

    decode_gemv: str | None = None  # as ColumnParallelLinear's

    def __init__(self, spec: ShardSpec, out_features: int, bias: bool, tp: TPGroup, dtype, device):
        super().__init__()
        assert spec.dim == 1
        self.spec, self.tp = spec, tp
        self.weight = nn.Parameter(
            torch.empty(out_features, spec.local_len, dtype=dtype, device=device)
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return linear(x, self.weight, self.bias, self.decode_gemv)
        y = self.tp.all_reduce(linear(x, self.weight, decode_gemv=self.decode_gemv))
        return y if self.bias is None else y + self.bias

    def param_shards(self) -> dict[str, ShardSpec]:
        return {"weight": self.spec}


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
