"""Model shapes for the throughput benchmark (BENCH.md): Llama-3 configs for `--load-format dummy`.

Only config.json is written; batchrun's dummy loader and HF's `from_config` build random weights
of the same shapes from it. `tiny` is a CPU-only shape that exercises the benchmark's logic.
"""

from __future__ import annotations

import json
from pathlib import Path

LLAMA3_COMMON = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=128256,
    num_attention_heads=32,
    num_key_value_heads=8,
    hidden_act="silu",
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    bos_token_id=128000,
    eos_token_id=128001,
    attention_bias=False,
    mlp_bias=False,
    initializer_range=0.02,
    torch_dtype="bfloat16",
    use_cache=True,
)

MODELS: dict[str, dict] = {
    # 16.1 GB of bf16 weights
    "llama-8b": dict(
        LLAMA3_COMMON,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        head_dim=128,
        tie_word_embeddings=False,
    ),
    # 2.5 GB of bf16 weights
    "llama-1b": dict(
        LLAMA3_COMMON,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    # NOTE: CPU smoke tests only. The vocab stays above the workloads' token ids (< 30000).
    "tiny": dict(
        LLAMA3_COMMON,
        vocab_size=32000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    ),
}


def write_model_dir(name: str, root: Path) -> Path:
    """Write `name`'s config.json under root/name and return that directory."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(MODELS[name], indent=2) + "\n")
    return path


def num_params(name: str) -> int:
    """Parameter count of a model shape (for the log: bf16 bytes = 2x this)."""
    c = MODELS[name]
    h, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q = c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
    emb = v * h * (1 if c["tie_word_embeddings"] else 2)
    return c["num_hidden_layers"] * layer + emb + h
