"""Tiny INT4 checkpoints (AWQ GEMM, GPTQ v1 / v2, compressed-tensors pack-quantized) in each
format's exact on-disk layout, written by a reference quantizer and packers of the tests' own
(nothing from batchrun.quant), and the fp32 weights each checkpoint stands for; the INT4 side of
quant_checkpoints.py (weight-only: no activation hooks).

    reference = write_int4_checkpoint("gptq", hf_model, path, group_size=32, act_order=True)
    reference_int4_model(hf_model, reference)(ids).logits         # what batchrun must compute
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

INT4_FORMATS = ("awq", "gptq", "pack-quantized")
# the checkpoint linears of a Llama-family decoder layer
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# nibble i of an AWQ word holds column 8c + AWQ_PACK_ORDER[i] (AutoAWQ's order_map)
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class RefInt4:
    """One linear quantized by the reference quantizer, before any packing."""

    q: torch.Tensor  # int64 [out, in], 0..15
    zeros: torch.Tensor  # int64 [out, groups], the zero points themselves (0..15)
    scales: torch.Tensor  # [out, groups], the checkpoint's scale dtype
    g_idx: torch.Tensor  # int64 [in], the group of each input column
    group_size: int  # -1: one group per row

    def dequantize(self) -> torch.Tensor:
        """fp32 [out, in]: (q - zero) * scale of each element's group."""
        z = self.zeros[:, self.g_idx].float()
        s = self.scales[:, self.g_idx].float()
        return (self.q.float() - z) * s


def reference_g_idx(in_features: int, group_size: int, act_order: bool, seed: int = 0):
    """Column i's group: i // group_size, or with act-order the group of its place in a random
    order of the columns (as GPTQ with desc_act assigns them)."""
    g = in_features if group_size == -1 else group_size
    if not act_order:
        return torch.arange(in_features) // g
    perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(in_features, dtype=torch.int64)
    g_idx[perm] = torch.arange(in_features) // g
    return g_idx


def quantize_int4(
    w: torch.Tensor,
    group_size: int,
    symmetric: bool,
    scale_dtype: torch.dtype,
    g_idx: torch.Tensor | None = None,
) -> RefInt4:
    """Round-to-nearest 4-bit quantization of `w` [out, in] per output row and group of input
    columns: symmetric (zero 8, scale max|w| / 7.5) or min-max (range through 0; zero points
    1..15, a range every format stores, GPTQ v1's zero minus one included)."""
    w = w.float()
    if g_idx is None:
        g_idx = reference_g_idx(w.shape[1], group_size, False)
    groups = int(g_idx.max()) + 1
    scales = torch.empty(w.shape[0], groups)
    zeros = torch.empty(w.shape[0], groups, dtype=torch.int64)
    for gid in range(groups):
        wg = w[:, g_idx == gid]
        if symmetric:
            scale = wg.abs().amax(1) / 7.5
            zero = torch.full_like(scale, 8, dtype=torch.int64)
        else:
            lo = wg.amin(1).clamp(max=0)
            hi = wg.amax(1).clamp(min=0)
            scale = (hi - lo) / 15
            zero = torch.round(-lo / scale.clamp(min=1e-12)).long().clamp(1, 15)
        scales[:, gid] = scale.clamp(min=1e-8)
        zeros[:, gid] = zero
    scales = scales.to(scale_dtype)
    s = scales.float()[:, g_idx]
    q = torch.round(w / s) + zeros[:, g_idx]
    return RefInt4(q.clamp(0, 15).long(), zeros, scales, g_idx, group_size)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits (0 .. 2**32 - 1) -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack_last(values: torch.Tensor) -> torch.Tensor:
    """int [..., 8n] -> int32 [..., n]: value 8w + i of the last dimension in bits 4i of word w."""
    v = values.long().reshape(*values.shape[:-1], -1, 8)
    return _to_int32((v << (4 * torch.arange(8))).sum(-1))


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] (0..15) -> int32 [R, C / 8] in AWQ's interleaved order: nibble i of word c
    holds column 8c + AWQ_PACK_ORDER[i] (AutoAWQ's order_map)."""
    rows, cols = values.shape
    order = torch.tensor(AWQ_PACK_ORDER)
    return _pack_last(values.reshape(rows, cols // 8, 8)[:, :, order].reshape(rows, cols))


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] -> int32 [R / 8, C]: nibble i of word r holds row 8r + i (GPTQ's qweight)."""
    return _pack_last(values.t()).t().contiguous()


def pack_columns(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] -> int32 [R, ceil(C / 8)]: nibble i of word c holds column 8c + i, the last
    word padded with zeros (GPTQ's qzeros, compressed-tensors' weight_packed)."""
    rows, cols = values.shape
    padded = torch.zeros(rows, -(-cols // 8) * 8, dtype=torch.int64)
    padded[:, :cols] = values.long()
    return _pack_last(padded)


def int4_tensors(
    fmt: str, ref: RefInt4, gptq_v2: bool = False, act_order: bool = False
) -> dict[str, torch.Tensor]:
    """The tensors one linear holds in format `fmt` (suffix -> tensor); `act_order`: a
    compressed-tensors checkpoint of actorder "group" (which stores weight_g_idx)."""
    if fmt == "awq":
        return {
            "qweight": pack_awq(ref.q.t()),  # [in, out / 8]
            "qzeros": pack_awq(ref.zeros.t()),  # [groups, out / 8]
            "scales": ref.scales.t().contiguous(),  # [groups, out]
        }
    if fmt == "gptq":
        # v1 (AutoGPTQ) stores each zero point minus one
        stored = ref.zeros if gptq_v2 else ref.zeros - 1
        return {
            "qweight": pack_rows(ref.q.t()),  # [in / 8, out]
            "qzeros": pack_columns(stored.t()),  # [groups, out / 8]
            "scales": ref.scales.t().contiguous(),
            "g_idx": ref.g_idx.to(torch.int32),
        }
    if fmt == "pack-quantized":
        # signed values -8..7 stored plus 8: the 0..15 of the reference quantizer
        out = {
            "weight_packed": pack_columns(ref.q),  # [out, ceil(in / 8)]
            "weight_scale": ref.scales.contiguous(),  # [out, groups]
            "weight_shape": torch.tensor(list(ref.q.shape)),
        }
        if not bool((ref.zeros == 8).all()):
            out["weight_zero_point"] = pack_columns(ref.zeros.t()).t().contiguous()
        if act_order:
            out["weight_g_idx"] = ref.g_idx.to(torch.int32)
        return out
    raise ValueError(fmt)


def int4_quantization_config(
    fmt: str, group_size: int, symmetric: bool, act_order: bool = False, gptq_v2: bool = False
) -> dict:
    """config.json's quantization_config as the format's tools write it."""
    if fmt == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": not symmetric,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    if fmt == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": act_order,
            "sym": symmetric,
            "damp_percent": 0.01,
            "true_sequential": True,
            "static_groups": False,
            "checkpoint_format": "gptq_v2" if gptq_v2 else "gptq",
        }
    if fmt == "pack-quantized":
        weights = {
            "num_bits": 4,
            "type": "int",
            "symmetric": symmetric,
            "group_size": None if group_size == -1 else group_size,
            "strategy": "channel" if group_size == -1 else "group",
            "dynamic": False,
            "actorder": "group" if act_order else None,
            "observer": "minmax",
        }
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": None,
                    "output_activations": None,
                    "format": "pack-quantized",
                }
            },
            "ignore": ["lm_head"],
            "kv_cache_scheme": None,
            "sparsity_config": {},
            "global_compression_ratio": None,
        }
    raise ValueError(fmt)


def write_int4_checkpoint(
    fmt: str,
    model,
    path: Path,
    group_size: int = 32,
    symmetric: bool = True,
    act_order: bool = False,
    gptq_v2: bool = False,
    num_shards: int = 2,
    skip: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """Save HF `model` (fp32) quantized in format `fmt` to `path`: config.json with its
    quantization_config and `num_shards` safetensors files (with an index) over which each
    layer's tensors are spread; the linears whose name contains an entry of `skip` stay plain
    weights, which the config names as its format does. Returns the fp32 state dict the
    checkpoint stands for: the dequantized weights, and every other tensor as stored (fp16 for
    AWQ and GPTQ, bf16 for compressed-tensors, as their tools save them)."""
    dtype = torch.bfloat16 if fmt == "pack-quantized" else torch.float16
    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        module, _, kind = name.rpartition(".")
        skipped = any(part in module for part in skip)
        if kind == "weight" and module.endswith(LINEARS) and not skipped:
            # act-order orders the columns by the linear's input statistics: the linears that
            # read the same input (q / k / v, gate / up) share their g_idx
            shared_input = module.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
            shared_input = shared_input.replace("up_proj", "gate_proj")
            seed = zlib.crc32(shared_input.encode())
            g_idx = reference_g_idx(value.shape[1], group_size, act_order, seed=seed)
            ref = quantize_int4(value, group_size, symmetric, dtype, g_idx)
            for suffix, t in int4_tensors(fmt, ref, gptq_v2, act_order).items():
                tensors[f"{module}.{suffix}"] = t
            reference[name] = ref.dequantize()
        else:
            tensors[name] = value.to(dtype).contiguous()
            reference[name] = tensors[name].float()
    config = model.config.to_dict()
    qcfg = int4_quantization_config(fmt, group_size, symmetric, act_order, gptq_v2)
    patterns = [f".*{re.escape(part)}.*" for part in skip]
    if fmt == "awq" and skip:
        qcfg["modules_to_not_convert"] = list(skip)
    elif fmt == "gptq" and skip:  # GPTQModel's negative dynamic rules
        qcfg["dynamic"] = {f"-:{p}": {} for p in patterns}
    elif fmt == "pack-quantized":
        qcfg["ignore"] += [f"re:{p}" for p in patterns]
    config["quantization_config"] = qcfg
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_sharded(tensors, path, num_shards)
    return reference


def save_sharded(tensors: dict[str, torch.Tensor], path: Path, num_shards: int) -> None:
    """Safetensors files model-0000i-of-0000n with an index; tensors dealt out in turn, so the
    parts of one linear (and the linears of one layer) sit in different files."""
    if num_shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return
    names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    parts: list[dict[str, torch.Tensor]] = [{} for _ in names]
    weight_map = {}
    for i, (key, t) in enumerate(sorted(tensors.items())):
        parts[i % num_shards][key] = t
        weight_map[key] = names[i % num_shards]
    for name, part in zip(names, parts):
        save_file(part, str(path / name))
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def reference_int4_model(model, reference: dict[str, torch.Tensor]):
    """A copy of HF `model` (fp32, eval) holding `reference` (write_int4_checkpoint's)."""
    import copy

    ref_model = copy.deepcopy(model)
    ref_model.load_state_dict(reference)
    return ref_model.float().eval()
