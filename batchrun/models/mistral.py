"""Mistral (MistralForCausalLM): Llama's blocks (models/llama.py) with sliding_window on every
layer unless it is null (4096 where config.json lacks the key, transformers' default)."""

from __future__ import annotations

from functools import partial

from batchrun.models import llama
from batchrun.models.spec import ArchSpec
from batchrun.models.windows import sliding_windows

SPEC = ArchSpec(name="MistralForCausalLM", model_type="mistral", family="Mistral",
                build=llama.build, windows=partial(sliding_windows, default=4096))  # fmt: skip
