"""Any tiny transformers model saved as a quantized checkpoint in the compressed-tensors layouts
(FP8 per channel with dynamic per-token activations, FP8 in 128x128 blocks with dynamic per-token
group activations, INT4 W4A16 pack-quantized) and Qwen's own block FP8 (quant_method fp8,
`weight_scale_inv`, modules_to_not_convert: give it full module names), written by the reference
quantizers of quant_checkpoints.py / quant_checkpoints_int4.py over what `save_pretrained`
wrote: every nn.Linear of the model that the `ignore` list leaves in is quantized, the rest
stays as saved.
Returns the fp32 model that batchrun must compute: the dequantized weights, and the format's
activation fake-quantization on the inputs of the quantized linears.

    hf = make_hybrid_model("qwen3_5_text", path)         # or make_gemma4(...)
    ref = quantize_saved(hf, "ct-fp8-channel", path, ignore=["lm_head", "re:.*in_proj_[ab]$"])
    ref(ids).logits                                       # what batchrun must compute
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from quant_checkpoints import (
    _compressed_tensors,
    _ct_args,
    _save,
    act_per_token,
    act_per_token_group,
    quantize_fp8,
)
from quant_checkpoints_int4 import int4_quantization_config, int4_tensors, quantize_int4
from safetensors import safe_open

# format -> the activations of its quantized linears
FORMATS = {"ct-fp8-channel": "dynamic", "ct-fp8-block": "dynamic", "pack-quantized": "none",
           "fp8-block": "dynamic"}  # fmt: skip
GROUP = 32  # the INT4 group size


def quantization_config(fmt: str, ignore: list[str]) -> dict:
    if fmt == "fp8-block":  # as Qwen3-Next-80B-A3B-Instruct-FP8 ships it: full module names
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128], "modules_to_not_convert": ignore}  # fmt: skip
    if fmt == "ct-fp8-channel":
        return _compressed_tensors(_ct_args("channel", False), _ct_args("token", True), ignore)
    if fmt == "ct-fp8-block":
        return _compressed_tensors(
            _ct_args("block", False, block_structure=[128, 128]),
            _ct_args("group", True, group_size=128),
            ignore,
        )
    return {**int4_quantization_config("pack-quantized", GROUP, symmetric=True), "ignore": ignore}


def quantize(fmt: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the linear's tensors as `fmt` stores them: suffix -> tensor, its dequantized weight)."""
    if fmt == "fp8-block":
        q, scale, deq = quantize_fp8(w, "block")
        return {"weight": q, "weight_scale_inv": scale.contiguous()}, deq
    if fmt.startswith("ct-fp8"):
        q, scale, deq = quantize_fp8(w, "block" if fmt == "ct-fp8-block" else "channel")
        return {"weight": q, "weight_scale": scale.contiguous()}, deq
    ref = quantize_int4(w, GROUP, True, torch.bfloat16)
    return int4_tensors("pack-quantized", ref), ref.dequantize()


def ignored(name: str, ignore: list[str]) -> bool:
    """compressed-tensors' rule: an exact name, or "re:REGEX" matched from the start."""
    return any(
        re.match(p[3:], name) is not None if p.startswith("re:") else p == name for p in ignore
    )


def quantize_saved(hf, fmt: str, path: Path, ignore: list[str], shards: int = 2):
    """Rewrite the checkpoint `hf.save_pretrained` left in `path` in format `fmt` (config.json's
    quantization_config with `ignore`; `shards` safetensors files, the scales in the last);
    returns `hf` as the reference (dequantized weights, activation hooks)."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
        f.unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    quantized = []
    for name, module in hf.named_modules():
        weight = f"{name}.weight"
        if not isinstance(module, torch.nn.Linear) or weight not in tensors:
            continue
        if ignored(name, ignore):
            continue
        stored, deq = quantize(fmt, tensors.pop(weight))
        tensors.update({f"{name}.{suffix}": t.contiguous() for suffix, t in stored.items()})
        with torch.no_grad():
            module.weight.copy_(deq)
        if FORMATS[fmt] == "dynamic":
            act = act_per_token if fmt == "ct-fp8-channel" else act_per_token_group
            module.register_forward_pre_hook(lambda mod, args, act=act: (act(args[0]),))
        quantized.append(name)
    assert quantized, "no linear quantized"
    _save(tensors, path, shards)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, ignore)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    hf.quantized = quantized
    return hf
