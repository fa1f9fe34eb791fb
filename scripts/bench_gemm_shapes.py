"""cuBLAS (torch.nn.functional.linear) TFLOP/s for a model's batch matmuls by row count: how
much a decode-only step's matmuls (M = the running batch) lose against a mixed step's (M = a
prefill chunk + the batch), which says whether spreading prefill tokens over more steps pays.

    python scripts/bench_gemm_shapes.py --model llama-8b --rows 256,1024,2048,3072,9216
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_models import MODELS  # noqa: E402
from cuda_timing import cycled_time_us  # noqa: E402


def matrices(cfg: dict) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the layer's matmuls."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i)}


def time_linear(m: int, n: int, k: int, dtype, iters: int) -> float:
    """Median seconds of one linear [m, k] x [n, k]^T, each call on its own weight copy
    (cycled past the L2), timed with CUDA events over a graph-free loop."""
    copies = max(2, (200 << 20) // (n * k * 2) + 1)
    ws = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    return cycled_time_us(lambda w: torch.nn.functional.linear(x, w), ws, iters, runs=3) / 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="llama-8b", help=f"of {', '.join(MODELS)}")
    p.add_argument("--rows", default="256,512,1024,2048,3072,4096,9216")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    cfg = MODELS[args.model]
    mats = matrices(cfg)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{args.model}: TFLOP/s of F.linear (bf16), per matrix and for the layer")
    print("rows | " + " | ".join(mats) + " | layer")
    for m in rows:
        cells, flops, secs = [], 0.0, 0.0
        for n, k in mats.values():
            t = time_linear(m, n, k, torch.bfloat16, args.iters)
            f = 2.0 * m * n * k
            cells.append(f"{f / t / 1e12:.0f}")
            flops, secs = flops + f, secs + t
        print(f"{m} | " + " | ".join(cells) + f" | {flops / secs / 1e12:.0f} ({1e6 * secs:.0f} µs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
