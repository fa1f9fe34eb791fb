"""Qwen3 (Qwen3ForCausalLM): Llama's blocks (models/llama.py) with an RMSNorm over each q and k
head before rotary; attention_bias also gives o_proj a bias; sliding layers as Qwen2's
(models/qwen2.py)."""

from __future__ import annotations

from batchrun.models import llama, qwen2
from batchrun.models.spec import ArchSpec

SPEC = ArchSpec(name="Qwen3ForCausalLM", model_type="qwen3", family="Qwen3", build=llama.build,
                qk_norm=True, o_proj_bias=True, windows=qwen2.WINDOWS)  # fmt: skip
