"""Tiny random HF models saved to disk, for parity tests against transformers (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    initializer_range=0.15,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def make_hf_config(kind: str):
    import transformers

    if kind == "llama":
        return transformers.LlamaConfig(**COMMON, rope_theta=10000.0)
    if kind == "llama3":  # rope scaling as in Llama 3.1
        return transformers.LlamaConfig(
            **COMMON,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        )
    if kind == "qwen2":
        return transformers.Qwen2Config(**COMMON, rope_theta=1000000.0)
    if kind == "qwen3":
        return transformers.Qwen3Config(**COMMON, head_dim=32, rope_theta=1000000.0)
    if kind == "tied":
        return transformers.LlamaConfig(**{**COMMON, "tie_word_embeddings": True})
    raise ValueError(kind)


def make_tiny_model(kind: str, path: Path, seed: int = 0):
    """Save a random model of `kind` to `path`; returns the HF model (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_hf_config(kind), dtype=torch.float32)
    model.eval()
    model.save_pretrained(path)
    # transformers may write the dtype as "dtype"; our loader reads both
    json.loads((path / "config.json").read_text())
    return model


def random_prompts(num: int, seed: int, min_len: int = 4, max_len: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        out.append(torch.randint(3, 256, (n,), generator=g).tolist())
    return out
