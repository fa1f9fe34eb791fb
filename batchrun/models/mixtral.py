"""Mixtral (MixtralForCausalLM): Llama's blocks with experts on every layer (num_local_experts,
intermediate_size: models/moe_config.py's experts_every_layer), stored under block_sparse_moe as
w1 / w3 / w2 (gate / up / down); sliding_window on every layer unless it is null (its default)."""

from __future__ import annotations

from functools import partial
from typing import Any

from batchrun.models import llama
from batchrun.models.moe_config import experts_every_layer
from batchrun.models.spec import ArchSpec
from batchrun.models.windows import sliding_windows

NAME = "MixtralForCausalLM"


def experts(raw: dict[str, Any], num_layers: int, source: str):
    return experts_every_layer(
        raw,
        NAME,
        num_layers,
        source,
        block_name="block_sparse_moe",
        expert_names=("w1", "w3", "w2"),
    )


SPEC = ArchSpec(name=NAME, model_type="mixtral", family="Mixtral", build=llama.build,
                moe=experts, windows=partial(sliding_windows, default=None))  # fmt: skip
