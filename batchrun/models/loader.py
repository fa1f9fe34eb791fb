"""Build a LlamaForCausalLM and fill it from safetensors (plain or sharded) or with random weights.

HF checkpoint names map onto our fused parameters:
    self_attn.{q,k,v}_proj  -> self_attn.qkv_proj  rows [0:q | q:q+kv | q+kv:q+2kv]
    mlp.{gate,up}_proj      -> mlp.gate_up_proj    rows [0:inter | inter:2*inter]

Those offsets are in the full (TP=1) tensor. Under tensor parallelism a parameter holds a slice
of it (its ShardSpec, batchrun/parallel/partition.py): each rank reads only the rows or columns
of each checkpoint tensor that fall in its slice (safetensors slices, no full tensor in memory),
and dummy weights are drawn full size and sliced, so TP=N gets TP=1's weights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from batchrun.config import KernelConfig
from batchrun.errors import WeightLoadError
from batchrun.layers.rotary import RotaryEmbedding
from batchrun.models.config import ModelConfig
from batchrun.models.dummy import init_dummy_
from batchrun.models.llama import LlamaForCausalLM
from batchrun.parallel.partition import ShardSpec, replicated
from batchrun.parallel.state import TPGroup

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED = ("rotary_emb.inv_freq",)


def build_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int,
    tp: TPGroup | None = None,
    kernels: KernelConfig | None = None,
) -> LlamaForCausalLM:
    """An uninitialized model on `device` (no time spent on random init of real weights), but
    for the vocabulary padding of the last TP rank, which is zeroed."""
    model = LlamaForCausalLM(cfg, dtype, "meta", max_positions, tp, kernels)
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, spec in model.param_shards().items():
            param = params[name]
            pad = param.shape[spec.dim] - spec.local_len
            if pad:
                param.narrow(spec.dim, spec.local_len, pad).zero_()
    # meta construction left the rotary tables empty: build them for real
    model.rotary = RotaryEmbedding(
        cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device, model.kernels
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
    tp: TPGroup | None = None,
    kernels: KernelConfig | None = None,
    dummy_init: str = "normal",
) -> LlamaForCausalLM:
    model = build_model(cfg, dtype, device, max_positions, tp, kernels)
    if load_format == "dummy":
        init_dummy_(model, dummy_init, seed=seed, shards=model.param_shards())
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
    params = dict(model.named_parameters())
    specs = model.param_shards()

    def spec_of(name: str) -> ShardSpec:
        return specs.get(name) or replicated(params[name].shape[0])

    # elements filled per parameter, to report what the checkpoint lacks
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
                param, spec = params[pname], spec_of(pname)
                # the shape this tensor has in the checkpoint (the full, TP=1 one)
                expected = list(param.shape)
                expected[spec.dim] = spec.full_size
                if rows != -1:
                    expected[0] = rows
                sliced = f.get_slice(name)
                shape = tuple(sliced.get_shape())
                if shape != tuple(expected):
                    raise WeightLoadError(
                        f"{path.name}: tensor {name!r} has shape {shape}, "
                        f"expected {tuple(expected)} from config.json"
                    )
                if spec.dim == 0:
                    pieces = spec.pieces(start, rows if rows != -1 else spec.full_size)
                else:  # split columns: the tensor fills the parameter's rows whole
                    pieces = spec.pieces(0, spec.full_size)
                for src, dst, n in pieces:
                    part = sliced[src : src + n] if spec.dim == 0 else sliced[:, src : src + n]
                    dest = param.data.narrow(spec.dim, dst, n)
                    dest.copy_(part.to(dest.dtype), non_blocking=True)
                    filled[pname] += dest.numel()
    missing = [n for n, p in params.items() if filled[n] < _real_numel(p, specs.get(n))]
    if missing:
        raise WeightLoadError(
            f"{model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}; "
            "the safetensors files are incomplete or belong to another model"
        )


def _real_numel(param: torch.Tensor, spec: ShardSpec | None) -> int:
    """Elements of `param` a checkpoint fills (all but the vocabulary padding)."""
    if spec is None:
        return param.numel()
    return param.numel() // param.shape[spec.dim] * spec.local_len
