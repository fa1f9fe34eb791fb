"""Convert a Llama-architecture GGUF file (llama.cpp format) into a Hugging Face model directory.

The output directory holds `model.safetensors` (dequantized weights), `config.json`,
`generation_config.json`, the tokenizer files (chat template included) and, written last, a
marker file. The directory appears atomically: everything is written into a temp directory next
to `out_dir` and renamed at the end, so a crash never leaves a half directory under `out_dir`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from batchrun.models import llama

# Written last; its presence means the directory is complete.
MARKER_FILE = "batchrun_gguf.json"
SUPPORTED_ARCHITECTURES = ("llama",)

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


class GGUFConversionError(ValueError):
    """The GGUF file cannot be converted (wrong architecture, quant type, missing metadata)."""


def _supported_qtypes() -> set[str]:
    # NOTE: `_type_traits` is the registry of quant types gguf.quants.dequantize knows about.
    traits = getattr(gguf.quants, "_type_traits", {})
    return {"F32", "F16"} | {t.name for t in traits}


def hf_tensor_name(gguf_name: str) -> str | None:
    """llama.cpp tensor name -> HF Llama parameter name (None when unknown)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.weight"
    return None


def reverse_rope_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of q/k weights (convert_hf_to_gguf.py `permute`).

    llama.cpp stores each head's rows as interleaved (even, odd) rotary pairs; HF keeps the two
    halves of the head apart. Same logic as transformers' LlamaTensorProcessor.
    """
    rows = w.shape[0]  # [num_heads * head_dim, hidden]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(tensor: Any, path: Path) -> np.ndarray:
    qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
    if qtype == gguf.GGMLQuantizationType.F32:
        return np.array(tensor.data, dtype=np.float32)  # copy: the reader's data is read-only
    if qtype == gguf.GGMLQuantizationType.F16:
        return np.array(tensor.data).astype(np.float32)
    if qtype.name not in _supported_qtypes():
        raise GGUFConversionError(
            f"{path}: tensor {tensor.name!r} has unsupported type {qtype.name}; "
            f"supported: {', '.join(sorted(_supported_qtypes()))}"
        )
    # GGUF lists dims innermost-first; the reader's data is already in numpy (row-major) order,
    # so the result is [out_features, in_features] like HF.
    return gguf.quants.dequantize(tensor.data, qtype)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _require(reader: Any, key: str, path: Path) -> Any:
    value = _field(reader, key)
    if value is None:
        raise GGUFConversionError(f"{path}: missing GGUF metadata key {key!r}")
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise GGUFConversionError(f"{path}: per-layer {key!r} ({value}) is not supported")
        value = value[0]
    return value


def build_hf_config(reader: Any, path: Path, dtype: torch.dtype) -> dict[str, Any]:
    """HF LlamaConfig dict from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFConversionError(
            f"{path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if (_field(reader, f"{arch}.expert_count") or 0) > 0:
        raise GGUFConversionError(f"{path}: mixture-of-experts llama GGUFs are not supported")
    hidden = int(_require(reader, f"{arch}.embedding_length", path))
    num_heads = int(_require(reader, f"{arch}.attention.head_count", path))
    num_kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", num_heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads))
    value_dim = int(_field(reader, f"{arch}.attention.value_length", head_dim))
    rot_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if value_dim != head_dim or rot_dim != head_dim:
        raise GGUFConversionError(
            f"{path}: key/value/rotary dims {head_dim}/{value_dim}/{rot_dim} differ; "
            "only full rotary with equal key and value dims is supported"
        )
    rope_theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        factor = float(_require(reader, f"{arch}.rope.scaling.factor", path))
        rope_parameters.update(rope_type="linear", factor=factor)
    elif scaling != "none":
        raise GGUFConversionError(f"{path}: rope scaling {scaling!r} is not supported")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab_size = _field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    names = {t.name for t in reader.tensors}
    return {
        "architectures": [llama.SPEC.name],
        "model_type": llama.SPEC.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(_require(reader, f"{arch}.feed_forward_length", path)),
        "num_hidden_layers": int(_require(reader, f"{arch}.block_count", path)),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": rope_theta,
        "rope_parameters": rope_parameters,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "vocab_size": vocab_size,  # checked against token_embd in load_hf_state_dict
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def load_hf_state_dict(
    reader: Any, path: Path, config: dict[str, Any], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            hint = " (llama3-style rope scaling)" if tensor.name == "rope_freqs.weight" else ""
            raise GGUFConversionError(
                f"{path}: unsupported tensor {tensor.name!r}{hint}; only plain Llama "
                "(token_embd, blk.N.attn_*/ffn_*, output_norm, output) is supported"
            )
        w = torch.from_numpy(np.ascontiguousarray(_dequantize(tensor, path)))
        if tensor.name.endswith(".attn_q.weight"):
            w = reverse_rope_permute(w, config["num_attention_heads"])
        elif tensor.name.endswith(".attn_k.weight"):
            w = reverse_rope_permute(w, config["num_key_value_heads"])
        state[name] = w.to(dtype).contiguous()
    embed = state.get("model.embed_tokens.weight")
    if embed is None:
        raise GGUFConversionError(f"{path}: no token_embd.weight tensor")
    config["vocab_size"] = int(embed.shape[0])  # [vocab, hidden]
    return state


def _save_tokenizer(reader: Any, gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer  # local: ~1 s to import, only for a conversion

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    template = _field(reader, "tokenizer.chat_template")
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = template
    tok.save_pretrained(str(out_dir))


def _fsync_tree(root: Path) -> None:
    for p in [*root.iterdir(), root]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Convert `gguf_path` into a HF Llama directory at `out_dir` (must not exist yet).

    Raises GGUFConversionError for unsupported files and FileExistsError when `out_dir` exists
    (also when another process renamed its result into place first).
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists")
    try:
        reader = gguf.GGUFReader(gguf_path)
    except (ValueError, OSError) as e:
        raise GGUFConversionError(f"{gguf_path}: not a readable GGUF file ({e})") from e
    config = build_hf_config(reader, gguf_path, dtype)
    state = load_hf_state_dict(reader, gguf_path, config, dtype)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del state
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        _save_tokenizer(reader, gguf_path, tmp)
        st = gguf_path.stat()
        marker = {
            "source": str(gguf_path.resolve()),
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "dtype": config["torch_dtype"],
        }
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        _fsync_tree(tmp)
        try:
            os.rename(tmp, out_dir)
        except OSError as e:  # a non-empty out_dir appeared meanwhile: the other writer won
            raise FileExistsError(f"{out_dir} already exists") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def is_converted(out_dir: Path) -> bool:
    return (Path(out_dir) / MARKER_FILE).is_file()
