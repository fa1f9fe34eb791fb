"""The fused MoE (kernels/fused_moe.py) on the GPU, per model shape and token count, in one run:

    fused       align + gate_up + down + top-k sum, the rule's tiles (pick_config)
    align       kernels/moe_align.py alone (a part of fused)
    rows        fused with MoeConfig gather=False at prefill sizes (64- and 128-row blocks),
                where the rule gathers x's routed rows in the aligned order and reads both
                GEMMs' operands through TMA descriptors (kernels/fused_moe_tma.py): x's rows
                gathered by the GEMMs themselves; --sweep varies it too
    grouped_mm  kernels/moe_grouped_mm.py (KernelPlan.moe_prefill "grouped_mm") at prefill sizes:
                the experts' matmuls on torch._grouped_mm (CUTLASS on sm_90), the whole MoE and
                its two grouped GEMMs alone (on inputs gathered beforehand)
    moe_gemv    kernels/moe_gemv.py (KernelPlan.moe_decode "gemv"), up to GEMV_MAX_ROWS
                routed rows: the decode batches' GEMVs against fused's grouped GEMMs
    loop        the per-expert torch loop (gather, F.linear x2, SiLU, index_add): the baseline
    dense       bf16 torch.mm of the same FLOPs and shapes: [T * k, H] x [H, 2I], then
                [T * k, I] x [I, H] (what the grouped GEMMs would cost as one dense GEMM each)

    python scripts/bench_fused_moe.py                                 # Qwen3-30B-A3B, Mixtral
    python scripts/bench_fused_moe.py --models qwen3-30b-a3b --tokens 1,8192 --sweep
    python scripts/bench_fused_moe.py --tokens 1,2,4,8               # moe_gemv against fused

Figures per row: µs per call; prefill TFLOP/s (6 T k H I) of fused and dense, and their ratio
(the issue's target: fused >= 70 % of dense at prefill sizes); decode GB/s of the expert weights
the batch touches (each touched expert's 3 H I weights read once) and its ratio to the copy
bandwidth of a 2 GiB device-to-device copy (the target: >= 70 %). With --sweep, other tiles per
shape; one that beats the rule's by more than a few % belongs in pick_config.

fused and dense are timed in a CUDA graph of many calls (as the engine runs them), cycling
routings so that a decode call reads its experts from HBM, not L2; the loop has host syncs
(torch.where) and is timed eagerly. Every fused result is checked against the loop first
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

# (E, k, H, I)
MODELS = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "qwen3-235b-a22b": (128, 8, 4096, 1536),
    "qwen1.5-moe-a2.7b": (60, 4, 2048, 1408),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
ROUTINGS = 16  # routings cycled per graph: decode calls touch other experts each time
GEMV_MAX_ROWS = 64  # routed rows up to which kernels/moe_gemv.py is timed too (its rule: 16)


def events_time_us(fn, calls: int, graph: bool) -> float:
    """µs per call of fn(i) for i in range(calls), in one CUDA graph or eagerly."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(2):
            fn(i)  # warm-up: compiles, allocates
    torch.cuda.current_stream().wait_stream(stream)
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(calls):
                fn(i)
        run = g.replay
    else:

        def run():
            for i in range(calls):
                fn(i)

    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 3
    start.record()
    for _ in range(reps):
        run()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (reps * calls)


def copy_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    us = events_time_us(lambda i: dst.copy_(src), 8, graph=True)
    return 2 * src.numel() * 2 / us / 1e3  # read + write


def torch_loop(x, w13, w2, topk_weights, topk_ids):
    inter = w2.shape[2]
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        tokens, slots = torch.where(topk_ids == expert)
        if len(tokens) == 0:
            continue
        h = F.linear(x[tokens], w13[expert])
        a = F.silu(h[:, :inter]) * h[:, inter:]
        down = F.linear(a, w2[expert]).float() * topk_weights[tokens, slots, None]
        y.index_add_(0, tokens, down)
    return y.to(x.dtype)


def sweep_configs(config):
    from batchrun.kernels.fused_moe import GemmTiles, MoeConfig

    out = []
    for bm, bn, bk, (warps, stages) in itertools.product(
        (16, 32, 64, 128), (32, 64, 128), (64, 128), ((4, 3), (4, 4), (8, 3), (8, 4))
    ):
        if bm * bn > 128 * 64 and warps == 4:
            continue
        tiles = GemmTiles(bn, bk, 8 if bm >= 64 else 1, warps, stages)
        for gather in (False, True) if bm >= 64 else (False,):
            out.append(MoeConfig(bm, tiles, config.down, gather))  # gate_up tiles varied
            out.append(MoeConfig(bm, config.gate_up, tiles, gather))  # down tiles varied
    return out


def bench_grouped_mm(r: dict, x, w13, w2, routings, want, calls: int) -> None:
    """grouped_mm's columns of a prefill row: the MoE, and its two grouped GEMMs alone."""
    from batchrun.kernels.fused_moe_tma import gather_rows
    from batchrun.kernels.moe_align import align_by_expert, max_blocks
    from batchrun.kernels.moe_grouped_mm import ALIGN_M, grouped_mm_moe

    n = len(routings)
    got = grouped_mm_moe(x, w13, w2, *routings[0])
    r["grouped_mm_error"] = float((got.float() - want).norm() / want.norm())
    r["grouped_mm_us"] = events_time_us(
        lambda i: grouped_mm_moe(x, w13, w2, *routings[i % n]), calls, graph=True
    )
    num_experts, top_k = w13.shape[0], routings[0][1].shape[1]
    rows = x.shape[0] * top_k
    align = align_by_expert(routings[0][1], num_experts, ALIGN_M, ends=True)
    xs = torch.empty((max_blocks(rows, num_experts, ALIGN_M) * ALIGN_M, x.shape[1]), device="cuda",
                     dtype=x.dtype)  # fmt: skip
    gather_rows(x, xs, None, align, rows, top_k)
    inter = torch.randn(xs.shape[0], w2.shape[2], device="cuda", dtype=x.dtype)
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)
    r["grouped_gemms_us"] = events_time_us(
        lambda i: (
            torch._grouped_mm(xs, w13_t, offs=align.ends),
            torch._grouped_mm(inter, w2_t, offs=align.ends),
        ),
        calls,
        graph=True,
    )
    r["grouped_rows"] = int(align.num_padded)


def bench(model: str, num_tokens: int, sweep: bool, copy_bw: float) -> dict:
    from batchrun.kernels.fused_moe import fused_moe, pick_config, tokens_per_pass
    from batchrun.kernels.moe_align import align_by_expert
    from batchrun.kernels.moe_gemv import moe_gemv, takes_gemv

    num_experts, top_k, hidden, inter = MODELS[model]
    torch.manual_seed(0)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(num_experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    routings = []
    for _ in range(ROUTINGS if num_tokens * top_k < 4 * num_experts else 2):
        logits = torch.randn(num_tokens, num_experts, device="cuda")
        weights, ids = torch.topk(logits.softmax(dim=-1), top_k, dim=-1)
        routings.append((weights / weights.sum(dim=-1, keepdim=True), ids.int()))
    config = pick_config(min(num_tokens, tokens_per_pass(top_k)), *MODELS[model])
    r = {"model": model, "tokens": num_tokens}
    r["config"] = [config.block_m, list(config.gate_up), list(config.down)]

    want = torch_loop(x, w13, w2, *routings[0]).float()
    got = fused_moe(x, w13, w2, *routings[0])
    r["error"] = float((got.float() - want).norm() / want.norm())
    calls = max(4, min(64, 65536 // (num_tokens * top_k)))
    n = len(routings)
    r["fused_us"] = events_time_us(
        lambda i: fused_moe(x, w13, w2, *routings[i % n]), calls, graph=True
    )
    r["align_us"] = events_time_us(
        lambda i: align_by_expert(routings[i % n][1], num_experts, config.block_m), calls, True
    )
    r["loop_us"] = events_time_us(lambda i: torch_loop(x, w13, w2, *routings[0]), 2, graph=False)

    if config.gather:  # 64- and 128-row blocks: prefill sizes
        by_rows = config._replace(gather=False)
        got = fused_moe(x, w13, w2, *routings[0], config=by_rows)
        r["rows_error"] = float((got.float() - want).norm() / want.norm())
        r["rows_us"] = events_time_us(
            lambda i: fused_moe(x, w13, w2, *routings[i % n], config=by_rows), calls, graph=True
        )
        bench_grouped_mm(r, x, w13, w2, routings, want, calls)
    rows = num_tokens * top_k
    xr = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    ar = torch.randn(rows, inter, device="cuda", dtype=torch.bfloat16)
    wa = torch.randn(hidden, 2 * inter, device="cuda", dtype=torch.bfloat16)
    wb = torch.randn(inter, hidden, device="cuda", dtype=torch.bfloat16)
    r["dense_us"] = events_time_us(lambda i: (xr @ wa, ar @ wb), calls, graph=True)

    flops = 6 * rows * hidden * inter
    r["fused_tflops"] = flops / r["fused_us"] / 1e6
    r["dense_tflops"] = flops / r["dense_us"] / 1e6
    touched = [int(torch.unique(ids).numel()) for _, ids in routings]
    weight_bytes = sum(touched) / n * 3 * hidden * inter * 2
    r["touched_experts"] = sum(touched) / n
    r["touched_gbps"] = weight_bytes / r["fused_us"] / 1e3
    r["touched_vs_copy"] = r["touched_gbps"] / copy_bw
    if rows <= GEMV_MAX_ROWS:
        got = moe_gemv(x, w13, w2, *routings[0])
        r["gemv_error"] = float((got.float() - want).norm() / want.norm())
        r["gemv_us"] = events_time_us(
            lambda i: moe_gemv(x, w13, w2, *routings[i % n]), calls, graph=True
        )
        r["gemv_touched_gbps"] = weight_bytes / r["gemv_us"] / 1e3
        r["takes_gemv"] = takes_gemv(num_tokens, top_k, num_experts)
    if sweep:
        timed = []
        for cfg in sweep_configs(config):
            try:
                out = fused_moe(x, w13, w2, *routings[0], config=cfg)
                if float((out.float() - want).norm() / want.norm()) > 1e-2:
                    timed.append((cfg, "wrong"))
                    continue
                fn = lambda i, c=cfg: fused_moe(x, w13, w2, *routings[i % n], config=c)  # noqa: E731
                timed.append((cfg, events_time_us(fn, calls, graph=True)))
            except Exception as e:  # e.g. out of shared memory: reported, not fatal
                timed.append((cfg, f"error: {type(e).__name__}"))
        ok = sorted((t for t in timed if isinstance(t[1], float)), key=lambda t: t[1])
        r["sweep_top"] = [(str(c), us) for c, us in ok[:5]]
        r["sweep_failed"] = [(str(c), why) for c, why in timed if not isinstance(why, float)]
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="qwen3-30b-a3b,mixtral-8x7b", help=f"of {list(MODELS)}")
    p.add_argument("--tokens", default="1,8,32,128,512,2048,8192,16384", help="comma-separated")
    p.add_argument("--sweep", action="store_true", help="time other tiles per shape")
    p.add_argument(
        "--pass-rows",
        type=int,
        help="routed rows a pass runs at most, in place of the kernels' bounds (fused_moe's "
        "MAX_CHUNK_ROWS, moe_grouped_mm's MAX_H_ELEMENTS): what larger "
        "passes, each reading every expert's weights once, are worth",
    )
    p.add_argument("--out", type=Path, default=benchlib.OUT_DIR)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fused_moe: needs CUDA")
        return 0
    if args.pass_rows:
        from batchrun.kernels import fused_moe, moe_grouped_mm

        fused_moe.MAX_CHUNK_ROWS = args.pass_rows
        moe_grouped_mm.MAX_H_ELEMENTS = 1 << 40
        print(f"passes of at most {args.pass_rows} routed rows")
    copy_bw = copy_gbps()
    report = {"environment": benchlib.environment("cuda"), "copy_gbps": copy_bw, "results": []}
    print(f"device-to-device copy: {copy_bw:.0f} GB/s")
    print(
        "| model | T | fused µs (align) | loop µs | dense µs | fused / dense TFLOP/s "
        "| touched experts | touched GB/s (of copy) | config | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for num_tokens in (int(v) for v in args.tokens.split(",")):
            r = bench(model, num_tokens, args.sweep, copy_bw)
            report["results"].append(r)
            torch.cuda.empty_cache()  # the model's experts, freed on return
            print(
                f"| {model} | {num_tokens} | {r['fused_us']:.1f} ({r['align_us']:.1f}) | "
                f"{r['loop_us']:.1f} | "
                f"{r['dense_us']:.1f} | {r['fused_tflops']:.0f} / {r['dense_tflops']:.0f} "
                f"({r['fused_tflops'] / r['dense_tflops']:.0%}) | {r['touched_experts']:.1f} | "
                f"{r['touched_gbps']:.0f} ({r['touched_vs_copy']:.0%}) | {r['config']} | "
                f"{r['error']:.1e} |",
                flush=True,
            )
            if "rows_us" in r:
                _, k, h, i = MODELS[model]
                tflops = 6 * num_tokens * k * h * i / r["rows_us"] / 1e6
                print(
                    f"    rows gathered by the GEMMs: {r['rows_us']:.1f} µs, {tflops:.0f} "
                    f"TFLOP/s ({r['dense_us'] / r['rows_us']:.0%} of dense), error "
                    f"{r['rows_error']:.1e}",
                    flush=True,
                )
                flops = 6 * num_tokens * k * h * i
                print(
                    f"    grouped_mm: {r['grouped_mm_us']:.1f} µs "
                    f"({r['dense_us'] / r['grouped_mm_us']:.0%} of dense), error "
                    f"{r['grouped_mm_error']:.1e}; its grouped GEMMs alone "
                    f"{r['grouped_gemms_us']:.1f} µs, {flops / r['grouped_gemms_us'] / 1e6:.0f} "
                    f"TFLOP/s ({r['dense_us'] / r['grouped_gemms_us']:.0%} of dense; "
                    f"{r['grouped_rows']} aligned rows for {num_tokens * k})",
                    flush=True,
                )
            if "gemv_us" in r:
                print(
                    f"    moe_gemv: {r['gemv_us']:.1f} µs, touched {r['gemv_touched_gbps']:.0f} "
                    f"GB/s ({r['gemv_touched_gbps'] / copy_bw:.0%} of copy), error "
                    f"{r['gemv_error']:.1e}, the rule takes it: {r['takes_gemv']}",
                    flush=True,
                )
            if args.sweep:
                print(f"    sweep top: {r['sweep_top']}; failed: {r['sweep_failed']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_fused_moe.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
