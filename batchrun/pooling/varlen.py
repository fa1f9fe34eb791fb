"""The decoder blocks' attention backend for one packed prefill-only step (varlen attention:
batchrun/attention/varlen.py; shared prefixes: pooling/shared_prefix.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from batchrun.attention.base import AttentionBackend
from batchrun.attention.varlen import varlen_attention
from batchrun.pooling.shared_prefix import prefix_attention

if TYPE_CHECKING:
    from batchrun.pooling.shared_prefix import PrefixPlan

__all__ = ["VarlenBackend", "varlen_attention"]


class VarlenBackend(AttentionBackend):
    """The decoder blocks' attention backend for one packed prefill-only step: causal attention
    within each sequence, nothing stored (`prepare` is not used: the plan gives the step). A plan
    whose sequences share prefixes attends each segment over its ancestors' keys
    (pooling/shared_prefix.py); `kv_rows` is plan.kv_rows on the device."""

    def __init__(self, plan: PrefixPlan, kv_rows: torch.Tensor | None = None):
        self.plan, self.kv_rows = plan, kv_rows

    def forward(self, q, k, v, layer_id, scaling, out=None, window=0, sinks=None):
        if sinks is not None:
            raise ValueError(
                "attention sinks (gpt-oss) are not supported for embed / rerank / score / classify"
            )
        if k is None:
            raise ValueError(
                "a layer that reads another layer's KV is not supported for embed / rerank / "
                "score / classify"
            )
        if self.kv_rows is None:
            result = varlen_attention(q, k, v, self.plan.seg_lens, scaling, True, window=window)
        else:
            result = prefix_attention(q, k, v, self.plan, self.kv_rows, scaling, window)
        if out is not None:
            out.view(result.shape).copy_(result)
            return out.view(result.shape)
        return result
