"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): Llama's blocks (models/llama.py) with a qkv bias by default
and, only with use_sliding_window true, sliding layers: those layer_types names
"sliding_attention", else the layers at index >= max_window_layers."""

from __future__ import annotations

from functools import partial

from batchrun.models import llama
from batchrun.models.spec import ArchSpec
from batchrun.models.windows import from_max_window_layers, sliding_windows

WINDOWS = partial(
    sliding_windows, default=4096, if_used=True, layer_types=True, windowed=from_max_window_layers
)

SPEC = ArchSpec(name="Qwen2ForCausalLM", model_type="qwen2", family="Qwen2/2.5",
                build=llama.build, qkv_bias=True, windows=WINDOWS)  # fmt: skip
