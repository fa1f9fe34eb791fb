"""Tiny quantized checkpoints in each format's exact on-disk layout, written by reference
quantizers of the tests' own, and the model batchrun's logits are compared against: an fp32
transformers model holding the dequantized weights, with the format's activation quantization
applied to the inputs of its quantized Linear modules by forward pre-hooks.

    ref = write_quantized("ct-fp8-channel", "llama", path)   # path: config.json + safetensors
    ref.hf(ids).logits                                         # what batchrun must compute

A format is a writer in WRITERS: (fp32 model, its calibration) -> the linears' tensors as
stored, their dequantized weights, the activation hook of each, and the quantization_config.
Each format lives in its own functions below (FP8 family first; add others after them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from tiny_models import COMMON, random_prompts

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# a tiny model whose projections are multiples of 128 (FP8 blocks of 128 x 128, also when
# split over two ranks): q 256 = 2 heads of 128, kv 256, MLP 512
BLOCK_SHAPES = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=128,
    num_hidden_layers=2,
)


# -- reference quantization (written here, independent of batchrun.quant) ------------------------


def fake_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to float8 e4m3 (clamped to +-448), times scale, in x's dtype."""
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.to(x.dtype) * scale


def dynamic_scale(amax: torch.Tensor) -> torch.Tensor:
    scale = amax / FP8_MAX
    return torch.where(scale == 0, torch.full_like(scale, torch.finfo(scale.dtype).eps), scale)


def act_per_token(x: torch.Tensor) -> torch.Tensor:
    return fake_fp8(x, dynamic_scale(x.abs().amax(dim=-1, keepdim=True)))


def act_per_token_group(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    cols = x.shape[-1]
    pad = -cols % group
    xp = torch.nn.functional.pad(x, (0, pad))
    xg = xp.unflatten(-1, (-1, group))
    out = fake_fp8(xg, dynamic_scale(xg.abs().amax(dim=-1, keepdim=True)))
    return out.flatten(-2)[..., :cols]


def quantize_fp8(w: torch.Tensor, weights: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 weight, scale as the formats store it, dequantized fp32 weight): weights
    "channel" (scale [out, 1]), "tensor" (scale [1]), "block" (scale [ceil(out/128),
    ceil(in/128)])."""
    w = w.float()
    if weights == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        full = scale
    elif weights == "tensor":
        scale = (w.abs().amax() / FP8_MAX).reshape(1)
        full = scale
    else:
        out_f, in_f = w.shape
        rows, cols = -(-out_f // 128), -(-in_f // 128)
        padded = torch.zeros(rows * 128, cols * 128)
        padded[:out_f, :in_f] = w
        scale = padded.view(rows, 128, cols, 128).abs().amax(dim=(1, 3)) / FP8_MAX
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out_f, :in_f]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale, q.float() * full


# -- the formats ----------------------------------------------------------------------------------


@dataclass
class Written:
    """What a writer makes of the model's linears."""

    tensors: dict[str, torch.Tensor]  # checkpoint name -> tensor as stored
    dequantized: dict[str, torch.Tensor]  # linear (checkpoint prefix) -> fp32 [out, in]
    hooks: dict[str, Callable[[torch.Tensor], torch.Tensor]]  # linear -> input transform
    quantization_config: dict


@dataclass
class Calibration:
    """Per linear (checkpoint prefix), the absolute maximum of its input on a few prompts."""

    amax: dict[str, float] = field(default_factory=dict)


def _linears(num_layers: int) -> list[str]:
    return [
        f"model.layers.{i}.{'self_attn' if n[0] in 'qkvo' else 'mlp'}.{n}"
        for i in range(num_layers)
        for n in PROJECTIONS
    ]


def _ct_args(strategy: str, dynamic: bool, **extra) -> dict:
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": extra.pop("group_size", None),
        "strategy": strategy,
        "dynamic": dynamic,
        **extra,
    }


def _compressed_tensors(weights: dict, inputs: dict | None, ignore: list[str]) -> dict:
    """config.json's quantization_config as compressed-tensors 0.20.1 writes it."""
    return {
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": inputs,
                "output_activations": None,
                "format": None,
            }
        },
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": None,
        "format": "float-quantized",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": ignore,
        "moe_sparsity_config": None,
    }


@dataclass(frozen=True)
class Fp8Format:
    weights: str  # "channel" | "tensor" | "block"
    activations: str  # "dynamic" | "static" | "none"
    scale_name: str
    scale_shape: str  # "as-is" (the reference quantizer's), "scalar" (shape [])
    ignore: str | None  # a regex of linears left unquantized (the config's ignore list)
    config: Callable[[], dict]
    input_scale_name: str = "input_scale"
    kv_scales: tuple[str, ...] = ()  # per-layer KV-cache scale names the format writes


FP8_FORMATS: dict[str, Fp8Format] = {
    # llm-compressor FP8_DYNAMIC, layer 1's down_proj ignored by a regex
    "ct-fp8-channel": Fp8Format(
        "channel",
        "dynamic",
        "weight_scale",
        "as-is",
        r"model\.layers\.1\.mlp\.down_proj",
        lambda: _compressed_tensors(
            _ct_args("channel", False),
            _ct_args("token", True),
            ["lm_head", r"re:.*layers\.1\.mlp\.down_proj$"],
        ),
    ),
    # llm-compressor FP8 (static)
    "ct-fp8-tensor": Fp8Format(
        "tensor",
        "static",
        "weight_scale",
        "as-is",
        None,
        lambda: _compressed_tensors(
            _ct_args("tensor", False),
            _ct_args("tensor", False, observer="static_minmax"),
            ["lm_head"],
        ),
    ),
    # llm-compressor FP8_BLOCK
    "ct-fp8-block": Fp8Format(
        "block",
        "dynamic",
        "weight_scale",
        "as-is",
        None,
        lambda: _compressed_tensors(
            _ct_args("block", False, block_structure=[128, 128]),
            _ct_args("group", True, group_size=128),
            ["lm_head"],
        ),
    ),
    # NVIDIA ModelOpt FP8, layer 1's MLP excluded by a wildcard, with the KV-cache scales
    "modelopt-fp8": Fp8Format(
        "tensor",
        "static",
        "weight_scale",
        "scalar",
        r"model\.layers\.1\.mlp\..*",
        lambda: {
            "quant_method": "modelopt",
            "quant_algo": "FP8",
            "kv_cache_quant_algo": "FP8",
            "exclude_modules": ["lm_head", "model.layers.1.mlp*"],
        },
        kv_scales=("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
    ),
    # Qwen3 "-FP8" / DeepSeek V3 style
    "fp8-block": Fp8Format(
        "block",
        "dynamic",
        "weight_scale_inv",
        "as-is",
        None,
        lambda: {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    ),
    # AutoFP8: per-tensor, static activations
    "fp8-tensor": Fp8Format(
        "tensor",
        "static",
        "weight_scale",
        "scalar",
        None,
        lambda: {
            "quant_method": "fp8",
            "activation_scheme": "static",
            "ignored_layers": ["lm_head"],
        },
    ),
}


def is_block(fmt: str) -> bool:
    return fmt in FP8_FORMATS and FP8_FORMATS[fmt].weights == "block"


def write_fp8(fmt: str, weights: dict[str, torch.Tensor], calib: Calibration) -> Written:
    spec = FP8_FORMATS[fmt]
    tensors, dequantized, hooks = {}, {}, {}
    for linear, w in weights.items():
        if spec.ignore is not None and re.fullmatch(spec.ignore, linear):
            continue
        q, scale, deq = quantize_fp8(w, spec.weights)
        if spec.scale_shape == "scalar":
            scale = scale.reshape(())
        tensors[f"{linear}.weight"] = q
        tensors[f"{linear}.{spec.scale_name}"] = scale.contiguous()
        dequantized[linear] = deq
        if spec.activations == "static":
            input_scale = torch.tensor(calib.amax[linear] / FP8_MAX)
            if spec.scale_shape != "scalar":
                input_scale = input_scale.reshape(1)
            tensors[f"{linear}.{spec.input_scale_name}"] = input_scale
            hooks[linear] = _static_hook(input_scale.reshape(()))
        elif spec.activations == "dynamic":
            hooks[linear] = act_per_token_group if spec.weights == "block" else act_per_token
    for linear in weights:
        for kv in spec.kv_scales:
            if linear.endswith(".self_attn.q_proj"):
                layer = linear.removesuffix("self_attn.q_proj")
                tensors[f"{layer}{kv}"] = torch.tensor(0.0125 if "k_scale" in kv else 0.025)
    return Written(tensors, dequantized, hooks, spec.config())


def _static_hook(scale: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: fake_fp8(x, scale)


WRITERS: dict[str, Callable[[str, dict[str, torch.Tensor], Calibration], Written]] = {
    name: write_fp8 for name in FP8_FORMATS
}


# -- writing a checkpoint ------------------------------------------------------------------------


def make_fp32_model(kind: str, block: bool = False, seed: int = 0):
    """A random tiny model of `kind` ("llama" or "qwen2": q/k/v biases), not saved."""
    import transformers
    from transformers import AutoModelForCausalLM

    shapes = {**COMMON, **(BLOCK_SHAPES if block else {})}
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind]
    theta = 10000.0 if kind == "llama" else 1000000.0
    torch.manual_seed(seed)
    config = config_cls(**shapes, rope_theta=theta)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def calibrate(model, num_prompts: int = 4) -> Calibration:
    """The inputs' absolute maximum of every Linear over a few random prompts."""
    calib = Calibration()
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS:

            def hook(mod, args, name=name):
                amax = float(args[0].abs().max())
                calib.amax[name] = max(calib.amax.get(name, 0.0), amax)

            handles.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        for prompt in random_prompts(num_prompts, seed=11, max_len=60):
            model(torch.tensor([prompt]))
    for h in handles:
        h.remove()
    return calib


def write_quantized(fmt: str, kind: str, path: Path, seed: int = 0, shards: int = 2):
    """Save a tiny `kind` model quantized in format `fmt` to `path` (config.json, safetensors in
    `shards` files with an index: a linear's weight and its scales in different files); returns
    the fp32 reference model (dequantized weights, activation hooks)."""
    model = make_fp32_model(kind, is_block(fmt), seed)
    calib = calibrate(model)
    state = model.state_dict()
    weights = {name: state[f"{name}.weight"] for name in _linears(model.config.num_hidden_layers)}
    written = WRITERS[fmt](fmt, weights, calib)
    tensors = {k: v.contiguous() for k, v in state.items() if k not in _quantized_weights(written)}
    tensors.update(written.tensors)
    _save(tensors, path, shards)
    config = model.config.to_dict()
    config["quantization_config"] = written.quantization_config
    config.pop("dtype", None)
    config["torch_dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return reference_model(model, written)


def _quantized_weights(written: Written) -> set[str]:
    return {f"{linear}.weight" for linear in written.dequantized}


def _save(tensors: dict[str, torch.Tensor], path: Path, shards: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return
    # the scales in the last file, the rest spread over the others
    names = sorted(tensors)
    plain = [n for n in names if not n.endswith("scale") and "scale_" not in n]
    scales = [n for n in names if n not in plain]
    groups = [plain[i :: shards - 1] for i in range(shards - 1)] + [scales]
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(path / fname))
        weight_map.update({n: fname for n in group})
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def reference_model(model, written: Written):
    """`model` with the dequantized weights and the activation hooks installed."""
    with torch.no_grad():
        for linear, deq in written.dequantized.items():
            model.get_submodule(linear).weight.copy_(deq)
    for linear, hook in written.hooks.items():
        model.get_submodule(linear).register_forward_pre_hook(
            lambda mod, args, hook=hook: (hook(args[0]),)
        )
    return model
