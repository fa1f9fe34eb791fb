"""Tiny random HF models saved to disk, for parity tests against transformers (no downloads)."""

from __future__ import annotations

import importlib.util
import json
import sys
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
    if kind == "mistral":
        return transformers.MistralConfig(**COMMON, rope_theta=1000000.0, sliding_window=None)
    if kind == "mistral-window":  # every layer attends over the last 8 positions
        return transformers.MistralConfig(**COMMON, rope_theta=1000000.0, sliding_window=8)
    if kind == "qwen2-window":  # layers 1 and 2 (index >= max_window_layers) over the last 8
        return transformers.Qwen2Config(
            **COMMON,
            rope_theta=1000000.0,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
        )
    if kind == "llama-d64":  # head dim 64: FlashInfer's smallest; GQA group 4
        return transformers.LlamaConfig(
            **{
                **COMMON,
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_attention_heads": 4,
                "num_key_value_heads": 1,
            },
            rope_theta=10000.0,
        )
    if kind == "mistral-nemo":  # head_dim 32 where hidden / heads is 16, as Mistral-Nemo's
        return transformers.MistralConfig(
            **COMMON, head_dim=32, rope_theta=1000000.0, sliding_window=None
        )
    if kind == "llama-bias":  # attention_bias and mlp_bias on a Llama config
        return transformers.LlamaConfig(
            **COMMON, attention_bias=True, mlp_bias=True, rope_theta=10000.0
        )
    if kind == "tied":
        return transformers.LlamaConfig(**{**COMMON, "tie_word_embeddings": True})
    if kind in MOE_KINDS:
        return make_moe_config(kind)
    if kind in PHI3_KINDS:
        return make_phi3_config(kind)
    if kind == "gemma3":
        return gemma3_text_config()
    if kind == "gpt_oss":
        from gptoss_models import gpt_oss_config

        return gpt_oss_config()
    if kind == "gemma3-mm":  # the text model inside a Gemma3ForConditionalGeneration
        return transformers.Gemma3Config(
            text_config=gemma3_text_config().to_dict(),
            vision_config=dict(
                model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
                num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14,
            ),
            mm_tokens_per_image=4,
            boi_token_index=300,  # outside the vocabulary, so no prompt has them
            eoi_token_index=301,
            image_token_index=302,
            tie_word_embeddings=True,
        )  # fmt: skip
    raise ValueError(kind)


# Phi-3 / Phi-4: fused qkv_proj / gate_up_proj, half of each head rotating (head_dim 16, rotary
# dim 8: 4 LongRoPE factors), LongRoPE with max_position_embeddings 512 over the original
# (attention factor sqrt(1 + ln(512 / original) / ln original)). "phi3": original 128, for an
# engine whose context is at most 128 (the short factors); "phi3-long": original 16, for the long
# factors (a context of 512)
PHI3_KINDS = ("phi3", "phi3-long")
PHI3_SHORT_FACTOR = [1.0, 1.25, 2.5, 4.0]
PHI3_LONG_FACTOR = [1.5, 3.0, 7.0, 16.0]


def make_phi3_config(kind: str, **changes):
    import transformers

    original = {"phi3": 128, "phi3-long": 16}[kind]
    return transformers.Phi3Config(
        **{
            **COMMON,
            "original_max_position_embeddings": original,
            "partial_rotary_factor": 0.5,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": PHI3_SHORT_FACTOR,
                "long_factor": PHI3_LONG_FACTOR,
            },
            "rope_theta": 10000.0,
            "sliding_window": None,
            **changes,
        }
    )


# Gemma 3's sliding window in the tiny models: prompts and generations run well past it
GEMMA3_WINDOW = 8


def gemma3_text_config(**changes):
    """A tiny Gemma 3 text config: layers sliding, full, sliding, full (the windowed ones with
    rope base 10000, the full ones 1e6 with linear scaling 8, as gemma-3-4b), head_dim 32 where
    hidden / heads is 16, query_pre_attn_scalar apart from head_dim, tied embeddings."""
    import transformers

    fields = {
        **COMMON,
        "num_hidden_layers": 4,
        "head_dim": 32,
        "query_pre_attn_scalar": 24,
        "sliding_window": GEMMA3_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
        "tie_word_embeddings": True,
        **changes,
    }
    return transformers.Gemma3TextConfig(**fields)


# mixtures of experts: one dense layer among MoE ones (qwen3_moe), a shared expert and an odd
# top-k without renormalization (qwen2_moe), every layer MoE with top-2 of 4 (mixtral)
MOE_KINDS = ("qwen3_moe", "qwen2_moe", "mixtral")


def make_moe_config(kind: str, **changes):
    import transformers

    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **{
                **COMMON,
                "head_dim": 32,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "norm_topk_prob": True,
                "mlp_only_layers": [1],
                "rope_theta": 1000000.0,
                **changes,
            }
        )
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **{
                **COMMON,
                "num_experts": 6,
                "num_experts_per_tok": 3,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 48,
                "norm_topk_prob": False,
                "rope_theta": 1000000.0,
                **changes,
            }
        )
    if kind == "mixtral":
        return transformers.MixtralConfig(
            **{
                **COMMON,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "intermediate_size": 48,
                "rope_theta": 1000000.0,
                "sliding_window": None,
                **changes,
            }
        )
    raise ValueError(kind)


def make_tiny_model(kind: str, path: Path, seed: int = 0):
    """Save a random model of `kind` to `path`; returns the HF model (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_hf_config(kind), dtype=torch.float32)
    model.eval()
    if kind.startswith("gemma3"):  # its norms start at w = 0 (a norm of 1 + w): spread them
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.3)
    if kind == "gpt_oss":
        from gptoss_models import spread_gpt_oss_

        spread_gpt_oss_(model)
    model.save_pretrained(path)
    # transformers may write the dtype as "dtype"; our loader reads both
    json.loads((path / "config.json").read_text())
    return model


# config.json of the benchmark's Llama 3 shapes (scripts/benchlib.py's MODELS: llama-8b,
# llama-1b, and the CPU-sized "tiny"), for dummy weights or a ModelConfig alone:
# batchrun/config.py's sizes and engine/kernel_choice.py's rules are stated for these
_BENCHLIB = Path(__file__).resolve().parents[1] / "scripts" / "benchlib.py"
benchlib = sys.modules.get("benchlib")
if benchlib is None:  # the scripts folder is no package: load the module from its file
    _spec = importlib.util.spec_from_file_location("benchlib", _BENCHLIB)
    benchlib = sys.modules["benchlib"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(benchlib)
LLAMA3_SHAPES: dict[str, dict] = benchlib.MODELS


def llama3_config_json(name: str, **changes) -> dict:
    """config.json of LLAMA3_SHAPES[name], with `changes` (config.json keys) applied."""
    return {**LLAMA3_SHAPES[name], **changes}


def write_config_dir(name: str, root: Path, **changes) -> Path:
    """root/name/config.json of llama3_config_json(name, **changes); returns root/name."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(llama3_config_json(name, **changes)))
    return path


def llama3_model_config(name: str, **changes):
    """The ModelConfig of llama3_config_json(name, **changes)."""
    from batchrun.models.config import ModelConfig

    return ModelConfig.from_dict(llama3_config_json(name, **changes))


def random_prompts(num: int, seed: int, min_len: int = 4, max_len: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        out.append(torch.randint(3, 256, (n,), generator=g).tolist())
    return out


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<s>", "<pad>"]


def save_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer: ids 0..255 are bytes, 256.. the ChatML specials; no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
    )
    fast.chat_template = CHATML
    fast.save_pretrained(path)


def make_tiny_chat_model(path: Path, seed: int = 0):
    """A tiny llama (vocab 260) with a byte tokenizer and a ChatML template, saved to `path`."""
    import transformers
    from transformers import AutoModelForCausalLM

    cfg = transformers.LlamaConfig(
        **{
            **COMMON,
            "vocab_size": 260,
            "eos_token_id": 257,
            "bos_token_id": 258,
            "pad_token_id": 259,
            "max_position_embeddings": 1024,
        }
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(path)
    save_byte_tokenizer(path)
    return model


# a small JSON schema that the tiny chat model's byte vocabulary can complete (the grammar tests
# on CPU and on the GPU)
TINY_JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "kind": {"enum": ["a", "bb", "ccc"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["ok", "kind", "n"],
}


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `prompt`: exactly n new tokens."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
