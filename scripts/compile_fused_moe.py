"""Compile the fused MoE's Triton kernels (kernels/moe_align.py, kernels/fused_moe.py) for sm_90
on a machine without a GPU, every tile config the rule picks at the real models' shapes, and
report each variant's registers and spills from ptxas:

    PYTHONPATH=/path/to/triton-3.6:$PWD python scripts/compile_fused_moe.py

A stand-in driver gives Triton the H200's target, and every launch becomes a warm-up (compile,
no launch), so the kernels' arguments are CPU tensors. Triton 3.6 (the H200's) is stricter than
later releases; a kernel that compiles here compiles there. Exits 1 if any variant fails or
spills.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

# (name, E, k, H, I) of the real models, the TP=2 and TP=8 widths of the largest
SHAPES = (
    ("qwen3-30b-a3b", 128, 8, 2048, 768),
    ("qwen3-235b-a22b", 128, 8, 4096, 1536),
    ("qwen3-235b-a22b tp8", 128, 8, 4096, 192),
    ("qwen1.5-moe-a2.7b", 60, 4, 2048, 1408),
    ("qwen1.5-moe-a2.7b tp8", 60, 4, 2048, 176),
    ("mixtral-8x7b", 8, 2, 4096, 14336),
    ("mixtral-8x7b tp2", 8, 2, 4096, 7168),
)
TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)


class StandInDriver:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda


def ptxas_usage(ptx: str) -> str:
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        proc = subprocess.run(
            [str(ptxas), "-v", "--gpu-name", "sm_90a", f.name, "-o", "/dev/null"],
            capture_output=True,
            text=True,
        )
    lines = [line.split("info    : ")[-1] for line in proc.stderr.splitlines()]
    return " | ".join(line for line in lines if "Used" in line or "spill" in line)


def main() -> int:
    driver.set_active(StandInDriver())
    seen: dict[str, str] = {}
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        key = f"{self.fn.__name__} {sorted((k, v) for k, v in kwargs.items())}"
        if key not in seen:
            seen[key] = ptxas_usage(kernel.asm["ptx"])
            print(f"   {key}\n      {seen[key]}")
        return kernel

    JITFunction.run = compile_only
    from batchrun.kernels.fused_moe import fused_moe, pick_config, tokens_per_pass

    failed = 0
    for name, experts, top_k, hidden, inter in SHAPES:
        for tokens in TOKENS:
            per_pass = min(tokens, tokens_per_pass(top_k))
            config = pick_config(per_pass, experts, top_k, hidden, inter)
            print(f"{name} T={tokens}: {config}")
            x = torch.empty(tokens, hidden, dtype=torch.bfloat16)
            w13 = torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16)
            w2 = torch.empty(experts, hidden, inter, dtype=torch.bfloat16)
            weights = torch.rand(tokens, top_k)
            ids = torch.zeros(tokens, top_k, dtype=torch.int32)
            try:
                fused_moe(x, w13, w2, weights, ids)
            except Exception as e:  # noqa: BLE001 (report every failing shape)
                failed += 1
                print(f"FAIL {name} T={tokens}: {type(e).__name__}: {str(e)[-600:]}")
    spilling = [key for key, usage in seen.items() if re.search(r"[1-9]\d* bytes spill", usage)]
    print(f"{len(seen)} variants compiled for sm_90, {failed} failures, {len(spilling)} spilling")
    return 1 if failed or spilling else 0


if __name__ == "__main__":
    sys.exit(main())
