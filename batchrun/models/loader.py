"""Build a LlamaForCausalLM and fill it from safetensors (plain or sharded) or with random weights.

HF checkpoint names map onto our fused parameters:
    self_attn.{q,k,v}_proj  -> self_attn.qkv_proj  rows [0:q | q:q+kv | q+kv:q+2kv]
    mlp.{gate,up}_proj      -> mlp.gate_up_proj    rows [0:inter | inter:2*inter]
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from batchrun.models.config import ModelConfig
from batchrun.models.layers import RotaryEmbedding, init_dummy_
from batchrun.models.llama import LlamaForCausalLM


class WeightLoadError(ValueError):
    """A checkpoint batchrun cannot load; the message names the file and tensor."""


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED = ("rotary_emb.inv_freq",)


def build_model(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, max_positions: int
) -> LlamaForCausalLM:
    """An uninitialized model on `device` (no time spent on random init of real weights)."""
    model = LlamaForCausalLM(cfg, dtype, "meta", max_positions)
    model.to_empty(device=device)
    # meta construction left the rotary tables empty: build them for real
    model.rotary = RotaryEmbedding(
        cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device
    )
    return model


def load_model(
    model_dir: str | Path | None,
    cfg: ModelConfig,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int,
    seed: int = 0,
) -> LlamaForCausalLM:
    model = build_model(cfg, dtype, device, max_positions)
    if load_format == "dummy":
        init_dummy_(model, seed=seed)
    else:
        load_safetensors(model, Path(model_dir), cfg)
    return model.eval()


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise WeightLoadError(
                f"{index} lists {missing[0].name}, which is missing from {model_dir} "
                f"({len(missing)} of {len(files)} shards missing); download the complete model"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(
            f"no *.safetensors in {model_dir}: batchrun loads Hugging Face safetensors "
            "checkpoints (or a .gguf file, or --load-format dummy for random weights)"
        )
    return files


def _target(name: str, cfg: ModelConfig) -> tuple[str, int, int] | None:
    """HF tensor name -> (our parameter name, row offset, row count); None to ignore."""
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", 0, cfg.vocab_size
    if name == "model.norm.weight":
        return "norm.weight", 0, cfg.hidden_size
    if name == "lm_head.weight":
        return None if cfg.tie_word_embeddings else ("lm_head.weight", 0, cfg.vocab_size)
    m = _LAYER.match(name)
    if not m:
        return None
    i, rest = m.group(1), m.group(2)
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
        "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
        "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
    }
    module, _, kind = rest.rpartition(".")
    if module in fused:
        target, start, rows = fused[module]
        return f"layers.{i}.{target}.{kind}", start, rows
    return f"layers.{i}.{rest}", 0, -1


def load_safetensors(model: LlamaForCausalLM, model_dir: Path, cfg: ModelConfig) -> None:
    from safetensors import safe_open

    params = dict(model.named_parameters())
    # rows filled per parameter, to report what the checkpoint lacks
    filled: dict[str, int] = {name: 0 for name in params}
    for path in safetensors_files(model_dir):
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:  # SafetensorError: truncated file, git-lfs pointer, ...
            raise WeightLoadError(
                f"{path}: not a readable safetensors file ({e}); a git-lfs pointer or an "
                "interrupted download? fetch the file again"
            ) from None
        with handle as f:
            for name in f.keys():
                if name.endswith(_IGNORED):
                    continue
                target = _target(name, cfg)
                if target is None:
                    continue
                pname, start, rows = target
                if pname not in params:
                    raise WeightLoadError(
                        f"{path.name}: unexpected tensor {name!r} for {cfg.architecture} "
                        f"(mapped to {pname!r}, which this model does not have); check that "
                        "config.json matches the weights"
                    )
                param = params[pname]
                dest = param.data if rows == -1 else param.data.narrow(0, start, rows)
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise WeightLoadError(
                        f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dest.shape)} from config.json"
                    )
                dest.copy_(tensor.to(dest.dtype), non_blocking=True)
                filled[pname] += dest.shape[0] if dest.dim() else 1
    missing = [n for n, p in params.items() if filled[n] < (p.shape[0] if p.dim() else 1)]
    if missing:
        raise WeightLoadError(
            f"{model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}; "
            "the safetensors files are incomplete or belong to another model"
        )
