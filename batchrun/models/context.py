"""The context a run serves: the model's `max_position_embeddings`, or a smaller cap
(`--max-model-len`, EngineConfig.context_len), and the KV cache its longest rows need."""

from __future__ import annotations

from batchrun.errors import ModelConfigError
from batchrun.models.config import ModelConfig

# bytes of one K or V element by KV cache dtype ("auto": the model's activations, 16-bit)
KV_ELEMENT_BYTES = {"auto": 2, "fp8_e4m3": 1}


# transformers' dynamic NTK rope rotates with the plain frequencies up to
# max_position_embeddings, and past it with a base grown for the longest position of each forward
# call, kept (a module state) for the calls after it: a prompt's keys then depend on the whole
# prompt's length, a generated token's on its own position, and a later request's on the longest
# one before it. A batched engine whose requests share cached prefix KV cannot give those tokens,
# so batchrun serves dynamic models up to max_position_embeddings, where it equals transformers.
DYNAMIC_NTK = "dynamic"


def served_context_len(cap: int | None, cfg: ModelConfig) -> int:
    """The context length a run serves: `cap` when given, else the model's
    max_position_embeddings. A cap above it is refused: batchrun's rotary tables end there, and
    `dynamic` (NTK) scaling, which transformers applies only past it, is thus never in effect
    (see DYNAMIC_NTK)."""
    limit = cfg.max_position_embeddings
    if cap is None:
        return limit
    if cap < 1 or cap > limit:
        why = ""
        if cfg.rope_scaling.get("rope_type") == DYNAMIC_NTK:
            why = (
                " (rope type 'dynamic': transformers' NTK scaling past it follows each forward's "
                "longest sequence and the calls before it, which a batched engine sharing "
                "cached prefixes does not reproduce)"
            )
        raise ModelConfigError(
            f"--max-model-len (context_len) {cap}: the model's context "
            f"(max_position_embeddings) is {limit}; give a length from 1 to {limit}{why}"
        )
    return cap


def kv_bytes_per_token(cfg: ModelConfig, kv_cache_dtype: str = "auto") -> int:
    """KV cache bytes a token takes over all layers (K and V), on one GPU (no tensor
    parallel): the layers that write KV (ModelConfig.kv_layers), each at its own heads and dims."""
    elements = sum(cfg.kv_heads_of(i) * cfg.head_dim_of(i) for i in cfg.kv_layers)
    return 2 * elements * KV_ELEMENT_BYTES[kv_cache_dtype]
