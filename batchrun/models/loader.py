"""Build a model (its architecture's spec: models/registry.py) and fill it from safetensors
(plain or sharded) or with random weights.

HF checkpoint names map onto our fused parameters:
    self_attn.{q,k,v}_proj  -> self_attn.qkv_proj  rows [0:q | q:q+kv | q+kv:q+2kv]
    mlp.{gate,up}_proj      -> mlp.gate_up_proj    rows [0:inter | inter:2*inter]
    mlp.shared_expert.{gate,up}_proj -> mlp.shared_expert.gate_up_proj
    {MoeConfig.block_name}.* -> mlp.* (the MoE block under another name)
    *.experts.{e}.*         -> mlp.w13, mlp.w2, stacked by models/moe_weights.py
    self_attn.qkv_proj, mlp.gate_up_proj (a fused checkpoint's, in our row order)
                            -> the same parameters, whole
and the spec's quirks: its tensor names (TensorNames: a multimodal checkpoint's text model,
renamed modules) and a reader of its own for expert tensors stored otherwise.

Those offsets are in the full (TP=1) tensor; a fused checkpoint tensor covers all of its
parameter's rows. Under tensor parallelism a parameter holds a slice
of it (its ShardSpec, batchrun/parallel/partition.py): each rank reads only the rows or columns
of each checkpoint tensor that fall in its slice (safetensors slices, no full tensor in memory),
and dummy weights are drawn full size and sliced, so TP=N gets TP=1's weights.

A quantized model's linears (ModelConfig.quantization) are not parameters: models/quant_loader.py
reads, decodes, slices and fuses them; a quantized mixture's experts are decoded by the same
sources and dequantized into w13 / w2 (models/moe_weights.py); this module reads everything else.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from batchrun.config import KernelPlan
from batchrun.errors import ModelConfigError, WeightLoadError
from batchrun.layers.rotary import uses_long_factors
from batchrun.models.blocks.context import BuildContext
from batchrun.models.blocks.model import CausalLM
from batchrun.models.checkpoint import Checkpoint, safetensors_files
from batchrun.models.config import ModelConfig
from batchrun.models.dummy import init_dummy_
from batchrun.models.moe_weights import (
    describe_experts,
    expert_target,
    load_expert,
    load_quantized_experts,
)
from batchrun.models.param_count import describe_params
from batchrun.models.quant_loader import (
    checkpoint_source,
    claimed_modules,
    dummy_source,
    load_kv_scale,
    load_quantized,
)
from batchrun.parallel.partition import ShardSpec, partition_model, replicated
from batchrun.parallel.state import TPGroup
from batchrun.quant.linear import QuantMatmul

__all__ = ["WeightLoadError", "build_model", "load_model", "safetensors_files"]

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED = ("rotary_emb.inv_freq",)
# safetensors dtypes of plain weights; anything else (F8_E4M3, I32, U8) is a quantized tensor
_PLAIN_DTYPES = ("F64", "F32", "F16", "BF16")


def build_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int,
    tp: TPGroup | None = None,
    kernels: KernelPlan | None = None,
) -> CausalLM:
    """An uninitialized model on `device` (no time spent on random init of real weights), but
    for the vocabulary padding of the last TP rank, which is zeroed."""
    spec = cfg.spec
    if cfg.quantization is not None and spec.fused_checkpoint:
        raise ModelConfigError(
            f"{cfg.architecture} with quantization ({cfg.quantization.describe()}) is not "
            "supported: its checkpoint's fused qkv_proj / gate_up_proj linears are read as "
            "plain bf16 / fp16 / fp32 weights only"
        )
    tp = tp or TPGroup()
    ctx = BuildContext(
        cfg=cfg,
        dtype=dtype,
        device="meta",
        kernels=kernels or KernelPlan.reference(),
        tp=tp,
        part=partition_model(cfg, tp.rank, tp.size),
        max_positions=max_positions,
    )
    model = spec.build(cfg, ctx)
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, spec in model.param_shards().items():
            param = params[name]
            pad = param.shape[spec.dim] - spec.local_len
            if pad:
                param.narrow(spec.dim, spec.local_len, pad).zero_()
    # meta construction left the rotary tables empty: build them for real
    model.make_rotaries(device)
    scaling = cfg.rope_scaling
    if scaling.get("rope_type") == "longrope":
        original = scaling["original_max_position_embeddings"]
        which = "long" if uses_long_factors(scaling, max_positions) else "short"
        log.info(
            "LongRoPE: the %s factors for every request (context %d, "
            "original_max_position_embeddings %d; layers/rotary.py says why)",
            which, max_positions, original,
        )  # fmt: skip
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
    kernels: KernelPlan | None = None,
    dummy_init: str = "normal",
) -> CausalLM:
    model = build_model(cfg, dtype, device, max_positions, tp, kernels)
    if load_format == "dummy":
        init_dummy_(model, dummy_init, seed=seed, shards=model.param_shards())
        if cfg.quantization is not None:
            source = dummy_source(cfg.quantization, torch.device(device), seed)
            load_quantized(model, source)
            load_quantized_experts(model, source)
    else:
        load_safetensors(model, Path(model_dir), cfg)
    log.info("weights: %s", describe_weights(model))
    return model.eval()


def describe_weights(model: CausalLM) -> str:
    """The weights' format and bytes on their device, for the start-up log."""
    tensors = list(model.parameters())
    for module in model.modules():
        if isinstance(module, QuantMatmul):
            tensors += [b for b in module.buffers() if b is not None]
    size = sum(t.nbytes for t in tensors)
    scheme = model.config.quantization
    what = scheme.describe() if scheme is not None else str(model.lm_head_weight.dtype)
    what += describe_experts(model.config)
    counts = describe_params(model.config)
    return f"{what}, {size / 1e9:.2f} GB on {model.lm_head_weight.device}; {counts}"


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
    i, rest = m.group(1), cfg.spec.names.layer_name(m.group(2))
    if cfg.moe is not None and rest.startswith(cfg.moe.block_name + "."):
        rest = "mlp." + rest[len(cfg.moe.block_name) + 1 :]
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    q *= 2 if cfg.attn_output_gate else 1  # q_proj's rows: [query | gate] per head
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
        "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
        "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
    }
    shared = cfg.moe.shared_expert_intermediate_size if cfg.moe is not None else 0
    if shared:
        fused["mlp.shared_expert.gate_proj"] = ("mlp.shared_expert.gate_up_proj", 0, shared)
        fused["mlp.shared_expert.up_proj"] = ("mlp.shared_expert.gate_up_proj", shared, shared)
    module, _, kind = rest.rpartition(".")
    if module in fused:
        target, start, rows = fused[module]
        return f"layers.{i}.{target}.{kind}", start, rows
    return f"layers.{i}.{rest}", 0, -1


def load_safetensors(model: CausalLM, model_dir: Path, cfg: ModelConfig) -> None:
    with Checkpoint(model_dir, cfg.spec.names) as ckpt:
        filled = _load_plain(model, ckpt, cfg)
        if cfg.quantization is not None:
            device = model.lm_head_weight.device
            source = checkpoint_source(ckpt, cfg.quantization, device)
            load_quantized(model, source)
            for name, n in load_quantized_experts(model, source).items():
                filled[name] += n
        _check_complete(model, ckpt, filled)


def _load_plain(model: CausalLM, ckpt: Checkpoint, cfg: ModelConfig) -> dict[str, int]:
    """Every parameter from the checkpoint: all but the quantized linears' weights and the
    quantized experts. Returns the elements filled per parameter."""
    params = dict(model.named_parameters())
    specs = model.param_shards()
    claimed = claimed_modules(model)

    def spec_of(name: str) -> ShardSpec:
        return specs.get(name) or replicated(params[name].shape[0])

    # elements filled per parameter, to report what the checkpoint lacks
    filled: dict[str, int] = {name: 0 for name in params}
    skipped = 0  # the tensors of what batchrun does not run (a vision tower)
    reader = cfg.spec.experts_reader
    experts = None if reader is None else reader(params, specs, cfg)
    for path, f in ckpt.files:
        for stored in f.keys():
            name = ckpt.names.text_name(stored)
            if name is None:
                skipped += 1
                continue
            if name.endswith(_IGNORED):
                continue
            if load_kv_scale(model, name, lambda _, f=f, stored=stored: f.get_tensor(stored)):
                continue
            module, _, kind = name.rpartition(".")
            if module in claimed and kind != "bias":
                continue  # read by the quantized linear (quant_loader)
            if experts is not None and experts.take(
                name, lambda f=f, stored=stored: f.get_tensor(stored), path
            ):
                continue
            expert = expert_target(name, cfg)
            if expert is not None and expert.param in params:
                param, spec = params[expert.param], specs[expert.param]
                sliced = f.get_slice(stored)
                filled[expert.param] += load_expert(expert, param, spec, sliced, path, name, cfg)
                continue
            target = _target(name, cfg)
            if target is None:
                continue
            pname, start, rows = target
            if pname not in params:
                raise WeightLoadError(
                    f"{path.name}: unexpected tensor {stored!r} for {cfg.architecture} "
                    f"(mapped to {pname!r}, which this model does not have); check that "
                    "config.json matches the weights"
                )
            param, spec = params[pname], spec_of(pname)
            # the shape this tensor has in the checkpoint (the full, TP=1 one)
            expected = list(param.shape)
            expected[spec.dim] = spec.full_size
            if rows != -1:
                expected[0] = rows
            sliced = f.get_slice(stored)
            shape = tuple(sliced.get_shape())
            if sliced.get_dtype() not in _PLAIN_DTYPES:
                raise WeightLoadError(
                    f"{path.name}: tensor {stored!r} is {sliced.get_dtype()}, a quantized "
                    f"tensor, where batchrun reads a plain weight: config.json's "
                    f"quantization_config ({_quant_text(cfg)}) does not cover {module}"
                )
            if shape != tuple(expected):
                raise WeightLoadError(
                    f"{path.name}: tensor {stored!r} has shape {shape}, "
                    f"expected {tuple(expected)} from config.json"
                )
            if spec.dim == 0:
                pieces = spec.pieces(start, rows if rows != -1 else spec.full_size)
            else:  # split columns: the tensor fills the parameter's rows whole
                pieces = spec.pieces(0, spec.full_size)
            # a norm_plus_one checkpoint stores each RMSNorm weight w as its offset from 1: the
            # norm multiplies by 1 + w, added here in fp32 (as transformers computes it) so
            # every norm kernel reads a plain weight
            plus_one = cfg.norm_plus_one and pname.endswith("norm.weight")
            for src, dst, n in pieces:
                part = sliced[src : src + n] if spec.dim == 0 else sliced[:, src : src + n]
                if plus_one:
                    part = part.float() + 1.0
                dest = param.data.narrow(spec.dim, dst, n)
                dest.copy_(part.to(dest.dtype), non_blocking=True)
                filled[pname] += dest.numel()
    if experts is not None:
        experts.check_complete()
        for pname, n in experts.filled.items():
            filled[pname] += n
    if skipped:
        log.info(
            "%d tensors of the vision tower, its projector or the MTP head skipped: batchrun "
            "runs the text model (images are refused per row)",
            skipped,
        )
    return filled


def _check_complete(model: CausalLM, ckpt: Checkpoint, filled: dict[str, int]) -> None:
    """WeightLoadError naming the parameters the checkpoint left (partly) unfilled."""
    specs = model.param_shards()
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if filled[n] < _real_numel(p, specs.get(n))]
    if missing:
        raise WeightLoadError(
            f"{ckpt.model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}; "
            "the safetensors files are incomplete or belong to another model"
        )


def _quant_text(cfg: ModelConfig) -> str:
    return "none" if cfg.quantization is None else cfg.quantization.describe()


def _real_numel(param: torch.Tensor, spec: ShardSpec | None) -> int:
    """Elements of `param` a checkpoint fills (all but the vocabulary padding)."""
    if spec is None:
        return param.numel()
    return param.numel() // param.shape[spec.dim] * spec.local_len
