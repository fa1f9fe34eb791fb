"""Qwen1.5-MoE / Qwen2-MoE (Qwen2MoeForCausalLM): Qwen2's attention (qkv bias by default) and
experts on the layers decoder_sparse_step and mlp_only_layers name, each beside a shared expert
whose output is gated by a sigmoid (models/moe_config.py's experts_by_step). Sliding layers only
with use_sliding_window true: those layer_types names, else the even layers below
max_window_layers."""

from __future__ import annotations

from functools import partial
from typing import Any

from batchrun.models import llama
from batchrun.models.moe_config import experts_by_step
from batchrun.models.spec import ArchSpec
from batchrun.models.windows import MAX_WINDOW_LAYERS, sliding_windows

NAME = "Qwen2MoeForCausalLM"


def even_below_max_window_layers(raw: dict[str, Any], num_layers: int) -> list[bool]:
    below = int(raw.get("max_window_layers", MAX_WINDOW_LAYERS))
    return [i % 2 == 0 and i < below for i in range(num_layers)]


def experts(raw: dict[str, Any], num_layers: int, source: str):
    return experts_by_step(raw, NAME, num_layers, source, shared_expert=True)


WINDOWS = partial(
    sliding_windows, default=4096, if_used=True, layer_types=True,
    windowed=even_below_max_window_layers,
)  # fmt: skip

SPEC = ArchSpec(name=NAME, model_type="qwen2_moe", family="Qwen1.5/2-MoE", build=llama.build,
                qkv_bias=True, windows=WINDOWS, moe=experts)  # fmt: skip
