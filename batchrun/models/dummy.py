"""Random weights for benchmarks (`load_format="dummy"`), seeded, drawn on the weights' device
in float32, so a model holds the same weights (rounded) in every dtype."""

from __future__ import annotations

import zlib

import torch
from torch import nn

UNIFORM_DUMMY_BOUND = 1e-3


def init_dummy_(
    module: nn.Module, kind: str = "normal", seed: int = 0, std: float = 0.02, shards=None
) -> None:
    """kind "normal": normal(0, std) with the norms at 1, near a real checkpoint's spread;
    "uniform": every parameter, the norms too, from U(-1e-3, 1e-3), as vLLM's and SGLang's
    dummy loaders draw them. NOTE: at the H200's power cap the matmuls' speed depends a little
    on the values they multiply: W1 llama-8b reads 0.3-0.6 % higher with "uniform"
    (`scripts/bench_throughput.py --workloads W1 --variants batchrun,dummy-uniform`).

    `shards` (name -> ShardSpec, from a tensor-parallel model's `param_shards()`): such a
    parameter holds a slice of a full tensor; the full tensor is drawn as at TP=1 and sliced, so
    every TP size gets the same logical weights.
    """
    if kind not in ("normal", "uniform"):
        raise ValueError(f"dummy init {kind!r} is not one of normal, uniform")
    uniform = kind == "uniform"
    bound = UNIFORM_DUMMY_BOUND
    shards = shards or {}
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") and not uniform:
                p.fill_(1.0)
                continue
            spec = shards.get(name)
            shape = list(p.shape)
            if spec is not None:
                shape[spec.dim] = spec.full_size
            if p.device.type == "cpu":
                if uniform:
                    full = torch.rand(shape, generator=gen, dtype=torch.float32) * 2 * bound - bound
                else:
                    full = torch.randn(shape, generator=gen, dtype=torch.float32) * std
            else:
                # NOTE: generate on the device (an 8B model is too slow to make on the host),
                # in float32 and then rounded, so every dtype holds the same logical weights:
                # CUDA's normal_ in bf16 draws other values than in float32 from the same seed.
                dev_gen = torch.Generator(device=p.device).manual_seed(
                    seed + zlib.crc32(name.encode())
                )
                in_place = spec is None and p.dtype == torch.float32
                full = p if in_place else torch.empty(shape, device=p.device)
                if uniform:
                    full.uniform_(-bound, bound, generator=dev_gen)
                else:
                    full.normal_(0.0, std, generator=dev_gen)
                if in_place:
                    continue
            if spec is None:
                p.copy_(full)
                continue
            for run in spec.runs:
                p.narrow(spec.dim, run.local_start, run.length).copy_(
                    full.narrow(spec.dim, run.full_start, run.length)
                )
