"""Tiny quantized mixtures of experts in their formats' exact on-disk layout (each expert's
gate_proj / up_proj / down_proj a linear of its own, as Qwen3-30B-A3B-FP8 ships them), written
by the reference quantizers of quant_checkpoints.py / quant_checkpoints_int4.py, and the fp32
transformers model that batchrun must compute: the dequantized weights everywhere, the format's
activation fake-quantization on the inputs of the quantized linears that are not experts (batchrun
runs the experts dequantized, their activations unquantized).

    hf = write_quantized_moe("fp8-block", path)      # path: config.json + safetensors
    hf(ids).logits                                     # what batchrun must compute
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from quant_checkpoints import (
    _compressed_tensors,
    _ct_args,
    _save,
    act_per_token_group,
    quantize_fp8,
)
from quant_checkpoints_int4 import (
    int4_quantization_config,
    int4_tensors,
    quantize_int4,
    reference_g_idx,
)
from tiny_models import make_moe_config

# a Qwen3-MoE whose attention and dense MLP split on 128-row blocks over two ranks (q 2 heads of
# 128, kv 2 heads, the dense layer 1's MLP 256 wide) and whose experts do not: 192 wide, 96 a
# rank, half a block (the experts are sliced after dequantization)
SHAPES = dict(
    hidden_size=256,
    intermediate_size=256,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=128,
    moe_intermediate_size=192,
    num_hidden_layers=3,
)
GROUP = 32  # the INT4 formats' group size

# format -> the activations of its quantized linears that are not experts
FORMATS = {
    "fp8-block": "dynamic",  # Qwen3 "-FP8": activations per token and group of 128
    "ct-fp8-channel": "none",  # compressed-tensors FP8 weights per channel, weight-only (W8A16)
    "gptq": "none",
    "awq": "none",
}


def _config(fmt: str, moe_layers: list[int]) -> dict:
    if fmt == "fp8-block":  # as the Qwen3-30B-A3B-FP8 config.json has it: every router
        return {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "modules_to_not_convert": [
                "lm_head",
                *(f"model.layers.{i}.mlp.gate" for i in moe_layers),
            ],
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        }
    if fmt == "ct-fp8-channel":
        return _compressed_tensors(
            _ct_args("channel", False), None, ["lm_head", "re:.*mlp\\.gate$"]
        )
    return int4_quantization_config(fmt, GROUP, symmetric=True)


def quantize(fmt: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the linear's tensors as `fmt` stores them: suffix -> tensor, its dequantized fp32
    weight)."""
    if fmt == "fp8-block":
        q, scale, deq = quantize_fp8(w, "block")
        return {"weight": q, "weight_scale_inv": scale.contiguous()}, deq
    if fmt == "ct-fp8-channel":
        q, scale, deq = quantize_fp8(w, "channel")
        return {"weight": q, "weight_scale": scale.contiguous()}, deq
    g_idx = reference_g_idx(w.shape[1], GROUP, False)
    ref = quantize_int4(w, GROUP, True, torch.float16, g_idx)
    return int4_tensors(fmt, ref), ref.dequantize()


def make_moe_model(seed: int = 0, kind: str = "qwen3_moe", **changes):
    """The fp32 model of SHAPES, not saved: kind "qwen3_moe" (layer 1 dense, 8 experts, top-2)
    or "qwen2_moe" (q/k/v biases, a shared expert, 6 experts, top-3)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    shapes = SHAPES if kind == "qwen3_moe" else {**SHAPES, "num_hidden_layers": 2}
    config = make_moe_config(kind, **{**shapes, **changes})
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def write_quantized_moe(
    fmt: str,
    path: Path,
    seed: int = 0,
    shards: int = 2,
    kind: str = "qwen3_moe",
    plain_experts: bool = False,
    **changes,
):
    """Save the tiny `kind` model quantized in `fmt` (FORMATS) to `path` (config.json,
    safetensors in `shards` files with an index); returns the fp32 reference model (the
    dequantized weights, the activation hooks of the linears that are not experts).
    `plain_experts`: the experts are saved unquantized, per expert, under the same config (as
    transformers 5 saves a compressed-tensors Qwen3-MoE, whose experts are not nn.Linear)."""
    model = make_moe_model(seed, kind, **changes)
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}  # our linear's / fused experts' name -> fp32
    hooks: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for name, value in state.items():
        module, _, kind = name.rpartition(".")
        if module.endswith("mlp.experts"):  # [E, 2I, H] gate | up, or [E, H, I] down
            if kind == "down_proj":
                parts = {"down_proj": list(value)}
            else:
                gate, up = value.chunk(2, dim=1)
                parts = {"gate_proj": list(gate), "up_proj": list(up)}
            deq = {}
            for proj, per_expert in parts.items():
                deq[proj] = []
                for e, w in enumerate(per_expert):
                    stored, d = ({"weight": w}, w) if plain_experts else quantize(fmt, w)
                    for suffix, t in stored.items():
                        tensors[f"{module}.{e}.{proj}.{suffix}"] = t.contiguous()
                    deq[proj].append(d)
            if kind == "down_proj":
                dequantized[name] = torch.stack(deq["down_proj"])
            else:
                dequantized[name] = torch.cat(
                    [torch.stack(deq["gate_proj"]), torch.stack(deq["up_proj"])], dim=1
                )
            continue
        linear = kind == "weight" and module.rsplit(".", 1)[-1].endswith("_proj")
        if linear:
            stored, d = quantize(fmt, value)
            for suffix, t in stored.items():
                tensors[f"{module}.{suffix}"] = t.contiguous()
            dequantized[name] = d
            if FORMATS[fmt] == "dynamic":
                hooks[module] = act_per_token_group
            continue
        tensors[name] = value.contiguous()
    _save(tensors, path, shards)
    config = model.config.to_dict()
    moe_layers = [
        i
        for i in range(model.config.num_hidden_layers)
        if f"model.layers.{i}.mlp.gate.weight" in state
    ]
    config["quantization_config"] = _config(fmt, moe_layers)
    config.pop("dtype", None)
    config["torch_dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(config, indent=2))
    with torch.no_grad():
        for name, d in dequantized.items():
            state_tensor = model.get_parameter(name)
            state_tensor.copy_(d)
    for module, hook in hooks.items():
        model.get_submodule(module).register_forward_pre_hook(
            lambda mod, args, hook=hook: (hook(args[0]),)
        )
    model.dequantized = dequantized
    return model
