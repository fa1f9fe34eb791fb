"""Decode FP8 matmuls on the GPU: kernels/fp8_gemv.py against the path it replaces,
quant_per_token + torch._scaled_mm (the torch quantization chain and cuBLASLt), and against
bf16 kernels/gemv.py on the same shape, per weight of the benchmark models at M = 1, 4, 16.
Answers what fp8_gemv's pick_config should be per shape: weight rows a program, K tiles and
splits.

    python scripts/bench_fp8_gemv.py                         # llama-1b and llama-8b, M = 1, 4, 16
    python scripts/bench_fp8_gemv.py --models llama-8b --m 1 --no-sweep

Timing as scripts/bench_gemv.py's (CUDA graphs of many calls cycling through weight copies past
the L2 cache, CUDA events, one run). Reports µs per call and the weight bytes read per second
(TB/s; e4m3 weights are half bf16's bytes), and per model the sum over one decode step (layers x
[qkv, o, gate_up with the SwiGLU, down]). Every kernel config is checked against scaled_mm first
(relative error <= 1e-2). Writes the figures as JSON under --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import benchlib
import torch
import torch.nn.functional as F
from bench_gemv import L2_BYTES, graph_time_us

from batchrun.engine.kernel_choice import supports_pdl
from batchrun.quant.act_quant import quant_per_token


def scaled_mm(x, w, sw):
    """The scaled_mm path of batchrun/quant/linear.py for a dynamic per-channel layer."""
    xq, sx = quant_per_token(x)
    return torch._scaled_mm(xq, w.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)


def sweep_configs(m: int, n: int, k: int):
    """pick_config's alternatives: 64 / 128 weight rows by K tiles 128 / 256 / 512 by splits
    1..8."""
    from batchrun.kernels.fp8_gemv import Fp8GemvConfig, pick_config

    base = pick_config(m, n, k)
    for bn, bk, sk in itertools.product((64, 128), (128, 256, 512), (1, 2, 4, 8)):
        cfg = Fp8GemvConfig(block_n=bn, block_k=bk, split_k=sk)
        if bk * sk <= k and cfg != base:
            yield cfg


def bench_shape(name: str, n: int, k: int, m: int, sweep: bool, pdl: bool) -> dict:
    from batchrun.kernels.activation import silu_and_mul
    from batchrun.kernels.fp8_gemv import fp8_gemv, pick_config
    from batchrun.kernels.gemv import gemv

    swiglu = name == "gate_up"
    copies = max(2, -(-L2_BYTES // (n * k)))
    fp8 = []
    for _ in range(copies):
        w = torch.randn(n, k, device="cuda") * 0.02
        sw = w.abs().amax(dim=1) / 448.0
        fp8.append(((w / sw[:, None]).to(torch.float8_e4m3fn), sw))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w0, sw0 = fp8[0]
    ref = scaled_mm(x, w0, sw0.reshape(1, -1)).float()
    if swiglu:
        ref = silu_and_mul(ref.bfloat16()).float()

    def run(cfg):
        return lambda pair: fp8_gemv(x, pair[0], pair[1], config=cfg, swiglu=swiglu, pdl=pdl)

    def correct(cfg) -> bool:
        out = run(cfg)(fp8[0]).float()
        return ((out - ref).norm() / ref.norm()).item() <= 1e-2

    def torch_path(pair):
        y = scaled_mm(x, pair[0], pair[1].reshape(1, -1))
        return silu_and_mul(y, pdl=pdl) if swiglu else y

    default = pick_config(m, n, k)
    out = {
        "scaled_mm_us": graph_time_us(torch_path, fp8),
        "default_config": default._asdict(),
        "default_correct": correct(default),
        "default_us": graph_time_us(run(default), fp8),
    }
    timed = []
    for cfg in sweep_configs(m, n, k) if sweep else ():
        if correct(cfg):
            timed.append((cfg._asdict(), graph_time_us(run(cfg), fp8)))
    timed.sort(key=lambda item: item[1])
    out["top_configs"] = timed[:8]
    out["best_us"] = min([out["default_us"]] + [us for _, us in timed])
    fp8.clear()
    bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(
        max(2, -(-L2_BYTES // (2 * n * k))))]  # fmt: skip
    out["bf16_gemv_us"] = graph_time_us(lambda w: gemv(x, w, swiglu=swiglu, pdl=pdl), bf16)
    out["bf16_cublas_us"] = graph_time_us(lambda w: F.linear(x, w), bf16)
    bf16.clear()
    torch.cuda.empty_cache()
    for key, nbytes in (("scaled_mm", n * k), ("default", n * k), ("best", n * k),
                        ("bf16_gemv", 2 * n * k)):  # fmt: skip
        out[f"{key}_tb_s"] = nbytes / (out[f"{key}_us"] * 1e-6) / 1e12
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="llama-1b,llama-8b")
    p.add_argument("--m", default="1,4,16", help="rows of x (decode batch), comma-separated")
    p.add_argument("--no-sweep", action="store_true", help="only the default config")
    p.add_argument("--matrices", default="qkv,o,gate_up,down", help="which of each model's")
    p.add_argument("--out", default=str(benchlib.OUT_DIR))
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("bench_fp8_gemv: needs an sm_89+ GPU (FP8)")
        return 0
    pdl = supports_pdl(torch.device("cuda"))
    report = {"device": torch.cuda.get_device_name(), "pdl": pdl, "results": []}
    for model in args.models.split(","):
        for m in (int(v) for v in args.m.split(",")):
            totals = {"scaled_mm": 0.0, "default": 0.0, "best": 0.0, "bf16_gemv": 0.0}
            print(f"\n{model}, M = {m} (µs a call, weight TB/s)")
            print(
                "| matrix | N x K | scaled_mm | fp8_gemv default | best | bf16 gemv | cuBLAS bf16 |"
            )
            print("|---|---|---|---|---|---|---|")
            for name, n, k, count in benchlib.linear_shapes(model):
                if name not in args.matrices.split(","):
                    continue
                r = bench_shape(name, n, k, m, not args.no_sweep, pdl)
                r.update(model=model, m=m, matrix=name, n=n, k=k, count=count)
                report["results"].append(r)
                for key in totals:
                    totals[key] += count * r[f"{key}_us"]
                flag = "" if r["default_correct"] else " WRONG"
                print(
                    f"| {name} | {n} x {k} | {r['scaled_mm_us']:.1f} ({r['scaled_mm_tb_s']:.2f}) "
                    f"| {r['default_us']:.1f}{flag} ({r['default_tb_s']:.2f}) | {r['best_us']:.1f} "
                    f"({r['best_tb_s']:.2f}) | {r['bf16_gemv_us']:.1f} ({r['bf16_gemv_tb_s']:.2f}) "
                    f"| {r['bf16_cublas_us']:.1f} |",
                    flush=True,
                )
                for cfg, us in r["top_configs"][:4]:
                    print(f"    {us:.1f} µs  {cfg}", flush=True)
            print(
                "per decode step (the layers' matmuls): "
                + ", ".join(f"{key} {v:.0f} µs" for key, v in totals.items())
            )
            report.setdefault("step_totals", []).append({"model": model, "m": m, **totals})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_fp8_gemv.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
