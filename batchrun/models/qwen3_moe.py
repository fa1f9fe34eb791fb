"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (q/k norms) and experts on the layers
decoder_sparse_step and mlp_only_layers name (models/moe_config.py's experts_by_step), no shared
expert. Sliding window on every layer, only with use_sliding_window true (transformers ignores
layer_types here)."""

from __future__ import annotations

from functools import partial
from typing import Any

from batchrun.models import llama
from batchrun.models.moe_config import experts_by_step
from batchrun.models.spec import ArchSpec
from batchrun.models.windows import sliding_windows

NAME = "Qwen3MoeForCausalLM"


def experts(raw: dict[str, Any], num_layers: int, source: str):
    return experts_by_step(raw, NAME, num_layers, source)


SPEC = ArchSpec(name=NAME, model_type="qwen3_moe", family="Qwen3-MoE", build=llama.build,
                qk_norm=True, o_proj_bias=True, moe=experts,
                windows=partial(sliding_windows, default=4096, if_used=True))  # fmt: skip
