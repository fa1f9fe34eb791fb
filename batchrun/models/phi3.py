"""Phi-3 / Phi-4 (Phi3ForCausalLM): Llama's blocks with
- no biases, whatever attention_bias / mlp_bias say (transformers' Phi3Attention, Phi3MLP);
- partial rotary: the first head_dim * partial_rotary_factor dims of each head rotate;
- LongRoPE, also under its older names "su" and "yarn" (Phi3Config reads "yarn" as LongRoPE),
  with original_max_position_embeddings 4096 where the file's top level has none;
- sliding_window on every layer unless it is null (its default);
- a checkpoint with qkv_proj and gate_up_proj stored fused, in our row order: plain weights
  only (the quantized linears are read from separate q / k / v and gate / up)."""

from __future__ import annotations

from functools import partial
from types import MappingProxyType

from batchrun.models import llama
from batchrun.models.spec import ArchSpec
from batchrun.models.windows import sliding_windows

SPEC = ArchSpec(name="Phi3ForCausalLM", model_type="phi3", family="Phi-3, Phi-4",
                build=llama.build, biases=False, partial_rotary=True,
                rope_aliases=MappingProxyType({"su": "longrope", "yarn": "longrope"}),
                longrope_original=4096, windows=partial(sliding_windows, default=None),
                fused_checkpoint=True)  # fmt: skip
