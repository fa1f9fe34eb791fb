"""cuBLAS (torch.nn.functional.linear) TFLOP/s for a model's batch matmuls by row count: how
much a decode-only step's matmuls (M = the running batch) lose against a mixed step's (M = a
prefill chunk + the batch), which says whether spreading prefill tokens over more steps pays.

    python scripts/bench_gemm_shapes.py --model llama-8b --rows 256,1024,2048,3072,9216

--sustain SECONDS times a whole forward's matmuls instead (every layer on its own weights, as
in a step), for that long a variant, the variants in turn over --rounds: how the step's M rows
go through cuBLAS, whole (`full`), in chunks of R rows (`chunk:R`), through cuBLASLt (`lt`),
or as the transposed product (`swap`: w @ x^T); `uniform` runs `full` on weights drawn from
U(-1e-3, 1e-3) (vLLM's and SGLang's dummy weights; the others' are normal(0, 0.02)) and
`uniform-x` also scales the inputs by 1e-3 (a norm whose weights are drawn so). A per-call
figure can flatter a shape: a short loop runs at clocks that a forward's sustained matmuls do
not keep (the H200 holds its 700 W cap at ~1,450 MHz through W1 llama-8b).

    python scripts/bench_gemm_shapes.py --model llama-8b --rows 9216,1008 --sustain 3 \
        --variants full,chunk:1024,chunk:2048,chunk:4608,lt
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
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


DATA_VARIANTS = ("uniform", "uniform-x")  # `full` on other values (see the docstring)


def run_variant(variant: str, xs: dict, layers: list, outs: dict) -> None:
    """One forward's matmuls: every layer's four weights against the rows of xs[name].
    `swap` computes the transposed product w @ x^T ([N, M]), which cuBLAS sees as a problem of
    other sizes and may give another kernel."""
    m = next(iter(xs.values())).shape[0]
    chunk = int(variant.split(":")[1]) if variant.startswith("chunk:") else m
    for layer in layers:
        for name, w in layer.items():
            a, out = xs[name], outs[name]
            if variant == "swap":
                torch.matmul(w, a.t(), out=out.view(out.shape[1], out.shape[0]))
                continue
            for r0 in range(0, m, chunk):
                torch.matmul(a[r0 : r0 + chunk], w.t(), out=out[r0 : r0 + chunk])


def sustained(cfg: dict, m: int, variants: list[str], seconds: float, rounds: int) -> None:
    """TFLOP/s of a forward's matmuls run back to back for `seconds` a variant, in turn."""
    mats = matrices(cfg)
    n_layers = cfg["num_hidden_layers"]
    layers = [
        {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
         for name, (n, k) in mats.items()}
        for _ in range(n_layers)
    ]  # fmt: skip
    xs = {name: torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
          for name, (_, k) in mats.items()}  # fmt: skip
    outs = {name: torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            for name, (n, _) in mats.items()}  # fmt: skip
    flops = n_layers * sum(2.0 * m * n * k for n, k in mats.values())
    data = {}  # variant -> (xs, layers) on other values, drawn once
    if any(v in DATA_VARIANTS for v in variants):
        u_layers = [{name: torch.empty_like(w).uniform_(-1e-3, 1e-3) for name, w in layer.items()}
                    for layer in layers]  # fmt: skip
        data["uniform"] = (xs, u_layers)
        data["uniform-x"] = ({name: x * 1e-3 for name, x in xs.items()}, u_layers)
    lib = torch.backends.cuda.preferred_blas_library()
    figures: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            torch.backends.cuda.preferred_blas_library("cublaslt" if v == "lt" else lib)
            v_xs, v_layers = data.get(v, (xs, layers))
            how = "full" if v in DATA_VARIANTS else v
            run_variant(how, v_xs, v_layers, outs)  # warm-up (heuristics, workspace)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            steps, t0 = 0, time.perf_counter()
            start.record()
            while time.perf_counter() - t0 < seconds:
                run_variant(how, v_xs, v_layers, outs)
                steps += 1
                if steps % 4 == 0:
                    torch.cuda.synchronize()  # keep the host within a few forwards
            end.record()
            end.synchronize()
            figures[v].append(flops * steps / (start.elapsed_time(end) / 1e3) / 1e12)
    torch.backends.cuda.preferred_blas_library(lib)
    print(f"{m} rows, {n_layers} layers, TFLOP/s by round ({seconds:g} s a variant a round):")
    for v, fs in figures.items():
        cells = " ".join(f"{f:6.1f}" for f in fs)
        print(f"  {v:12s} {cells} | median {statistics.median(fs):.1f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="llama-8b", help=f"of {', '.join(MODELS)}")
    p.add_argument("--rows", default="256,512,1024,2048,3072,4096,9216")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sustain", type=float, default=0.0, help="seconds a variant (see above)")
    p.add_argument("--variants", default="full,chunk:1024,lt", help="with --sustain")
    p.add_argument("--rounds", type=int, default=3, help="with --sustain")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    cfg = MODELS[args.model]
    mats = matrices(cfg)
    rows = [int(r) for r in args.rows.split(",")]
    if args.sustain > 0:
        for m in rows:
            sustained(cfg, m, args.variants.split(","), args.sustain, args.rounds)
        return 0
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
