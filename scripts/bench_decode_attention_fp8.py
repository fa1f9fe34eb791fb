"""Micro-benchmark of decode attention reading an FP8 KV cache against a bf16 one (GPU only).

    python scripts/bench_decode_attention_fp8.py [--cases 1x8192,64x2048] [--json OUT.json]

For each case (batch x context, GQA 32/8, head dim 128, bf16 queries, each request's KV in
shuffled pool slots): the Triton decode kernel (kernels/decode_attention.py) with the split
count the backend picks, on a bf16 pool and on a float8_e4m3fn pool with k/v scales, and a few
tile configurations on the float8 pool. Each row gives the median time (triton.testing.do_bench,
L2 flushed), the KV bytes read per second (K and V of every request's context, 1 or 2 bytes an
element) and that as a fraction of the device-to-device copy bandwidth measured in the same run
(a torch copy of a 1 GiB buffer, bytes read + written). The figure: the float8 pool's default row at
>= 80 % of the copy bandwidth where the bf16 one is (batch x context large enough to be
memory-bound), and its time about half the bf16 one's.
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import replace
from pathlib import Path

import torch
from batchrun.kernels.decode_attention import (
    decode_attention_fwd,
    decode_counters,
    decode_workspace_numel,
)
from triton.testing import do_bench

from batchrun.attention.base import AttentionInputs
from batchrun.attention.triton_backend import TritonAttentionBackend
from batchrun.config import KernelPlan
from batchrun.engine.kernel_choice import supports_pdl
from batchrun.engine.kv_pool import KVPool
from batchrun.quant.kv_cache import KVScale, quantize_kv

H, KV, D = 32, 8, 128  # llama-8b's attention
DEV = "cuda"
DEFAULT_CASES = "1x8192,16x4096,64x2048,256x1024,256x4096,512x2048"
# (BLOCK_N, warps, stages) tried on the float8 pool besides the kernel's default
FP8_CONFIGS = [(64, 4, 4), (128, 4, 3), (128, 8, 3), (128, 4, 2)]
# the float8 pool's dots on fp16 operands (the default, FP8_FP16_DOT) against bf16 ones: each
# config above is timed both ways
SCALE = KVScale(float(torch.tensor(0.37)), float(torch.tensor(2.5)))


def copy_bandwidth() -> float:
    """TB/s of a device-to-device copy (bytes read + written)."""
    src = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return 2 * src.numel() / do_bench(functools.partial(dst.copy_, src), return_mode="median") / 1e9


def build(batch_size: int, context: int, dtype: torch.dtype, kernels: KernelPlan):
    """(pool, req_to_token, inputs, q, k, v): contexts of `context` tokens in shuffled slots."""
    gen = torch.Generator().manual_seed(0)
    total = batch_size * context
    fp8 = dtype == torch.float8_e4m3fn
    pool = KVPool(1, total + 1, KV, D, dtype, DEV, kernels, [SCALE] if fp8 else None)
    for buf in pool.buffers(0):
        x = torch.randn(buf.shape, device=DEV)
        buf.copy_(quantize_kv(x, SCALE.inv_k) if fp8 else x)
    slots = torch.randperm(total, generator=gen).int().view(batch_size, context)
    table = torch.zeros(batch_size + 1, context, dtype=torch.int32)
    table[:batch_size] = slots
    inputs = AttentionInputs(
        req_pool_indices=torch.arange(batch_size, device=DEV),
        seq_lens=torch.full((batch_size,), context, dtype=torch.int64, device=DEV),
        extend_lens=torch.ones(batch_size, dtype=torch.int64, device=DEV),
        out_cache_loc=slots[:, -1].long().to(DEV),
        seq_lens_cpu=(context,) * batch_size,
        extend_lens_cpu=(1,) * batch_size,
    )
    q, k, v = (torch.randn(batch_size, n, D, device=DEV, dtype=torch.bfloat16) for n in (H, KV, KV))
    return pool, table.to(DEV), inputs, q, k, v


def bench_case(batch_size: int, context: int, copy_tbs: float, rows: list[dict]) -> None:
    kernels = replace(
        KernelPlan.reference(),
        attention="triton",
        triton_ops=True,
        pdl=supports_pdl(torch.device(DEV)),
    )
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        bench_pool(batch_size, context, dtype, kernels, copy_tbs, rows)
        torch.cuda.empty_cache()


def bench_pool(batch_size, context, dtype, kernels, copy_tbs: float, rows: list[dict]) -> None:
    """The rows of one case on a pool of `dtype`."""
    name = f"{batch_size}x{context}"
    pool, table, inputs, q, k, v = build(batch_size, context, dtype, kernels)
    fp8 = dtype == torch.float8_e4m3fn
    gbytes = 2 * batch_size * context * KV * D * pool.k_buffers[0].element_size() / 1e9
    backend = TritonAttentionBackend(pool, table, kernels)
    backend.prepare(inputs)
    splits = backend._plan.num_kv_splits
    out = torch.empty_like(q)
    workspace = torch.empty(decode_workspace_numel(batch_size, H, D, splits), device=DEV)
    counters = decode_counters(batch_size, KV, DEV)

    def add(label: str, ms: float) -> None:
        tbs = gbytes / ms
        rows.append(
            {"case": name, "kv": str(dtype).split(".")[-1], "variant": label, "ms": ms,
             "TB/s": tbs, "of copy": tbs / copy_tbs}
        )  # fmt: skip
        kv = "fp8 " if fp8 else "bf16"
        print(f"{name:10s} {kv} {label:34s} {ms * 1e3:9.1f} us {tbs:6.2f} TB/s "
              f"{100 * tbs / copy_tbs:5.1f} % of copy", flush=True)  # fmt: skip

    configs = [(None, None)]
    if fp8:
        configs += [(None, False)] + [(c, d) for c in FP8_CONFIGS for d in (True, False)]
    for config, fp16_dot in configs:
        tiles = {} if fp16_dot is None else {"fp16_dot": fp16_dot}
        if config is not None:
            tiles.update(block_n=config[0], num_warps=config[1], num_stages=config[2])
        fn = functools.partial(
            decode_attention_fwd, q, *pool.buffers(0), out, table, inputs.req_pool_indices,
            inputs.seq_lens, D**-0.5, splits, workspace, counters,
            kv_scale=SCALE if fp8 else None, pdl=kernels.pdl, **tiles,
        )  # fmt: skip
        label = f"triton {splits} splits " + ("default" if config is None else str(config))
        if fp16_dot is not None:
            label += " fp16 dot" if fp16_dot else " bf16 dot"
        add(label, do_bench(fn, return_mode="median"))


def summarize(rows: list[dict]) -> None:
    print("\nsummary: default Triton decode, fp8 against bf16 KV")
    for case in dict.fromkeys(r["case"] for r in rows):
        got = {r["kv"]: r for r in rows if r["case"] == case and r["variant"].endswith("default")}
        bf16, fp8 = got["bfloat16"], got["float8_e4m3fn"]
        best = min((r for r in rows if r["case"] == case and r["kv"] == "float8_e4m3fn"),
                   key=lambda r: r["ms"])  # fmt: skip
        print(f"{case:10s} bf16 {bf16['ms'] * 1e3:8.1f} us ({100 * bf16['of copy']:5.1f} %)  "
              f"fp8 {fp8['ms'] * 1e3:8.1f} us ({100 * fp8['of copy']:5.1f} %)  "
              f"speed-up {bf16['ms'] / fp8['ms']:4.2f}x  best fp8: {best['variant']} "
              f"{best['ms'] * 1e3:.1f} us")  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated BATCHxCONTEXT")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("bench_decode_attention_fp8: needs a CUDA GPU of sm_89+ (float8 conversions)")
        return
    copy_tbs = copy_bandwidth()
    print(f"device-to-device copy: {copy_tbs:.2f} TB/s (bytes read + written)")
    rows: list[dict] = []
    for case in args.cases.split(","):
        batch_size, context = (int(x) for x in case.split("x"))
        bench_case(batch_size, context, copy_tbs, rows)
    summarize(rows)
    if args.json is not None:
        args.json.write_text(json.dumps({"copy TB/s": copy_tbs, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
