"""Micro-benchmark of the Triton attention kernels over the paged KV (GPU only).

    python scripts/bench_attention_kernels.py [--json OUT.json]
    python scripts/bench_attention_kernels.py --decode-run 1008x640 --loaded 32:2
    python scripts/bench_attention_kernels.py --extend-cases 16x512,8x1024,8x1024+1024

Decode (one query token per request, GQA 32/8, head dim 128, bf16): achieved KV-read bandwidth
(K and V bytes of every request's context / kernel time) against the 4.27 TB/s copy ceiling, for
a sweep of kernel configurations, the backend's own choice (eager and CUDA-graph replay) and the
torch reference backend. Extend (8 requests x 1024 new tokens, prefix 0 and 1024): TFLOP/s of
the causal attention against the torch reference backend and, for prefix 0, torch's own
scaled_dot_product_attention on contiguous (unpaged) tensors; on extends also the Triton backend
with its extend rows on FlashInfer's FlashAttention-3 prefill ("fa3") where it runs.
Timings are medians of triton.testing.do_bench (L2 flushed between runs) unless marked "graph".
The kernels run as the engine runs them on this GPU (KERNELS).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from dataclasses import replace

import torch
import triton
import triton.language as tl
from batchrun.kernels.decode_attention import (
    decode_attention_fwd,
    decode_counters,
    decode_workspace_numel,
)
from batchrun.kernels.extend_attention import extend_attention_fwd
from triton.testing import do_bench, do_bench_cudagraph

from batchrun.attention import fa3_cache
from batchrun.attention.base import AttentionInputs
from batchrun.attention.torch_backend import TorchAttentionBackend
from batchrun.attention.triton_backend import TritonAttentionBackend
from batchrun.config import KernelPlan
from batchrun.engine.kernel_choice import supports_pdl
from batchrun.engine.kv_pool import KVPool

H, KV, D, DTYPE = 32, 8, 128, torch.bfloat16
DEV = "cuda"
# what the engine resolves on this GPU for the attention's path: Triton ops, PDL on sm_90+
KERNELS = replace(
    KernelPlan.reference(),
    attention="triton",
    triton_ops=True,
    pdl=torch.cuda.is_available() and supports_pdl(torch.device(DEV)),
)
DECODE_CONFIGS = [(bn, w, s) for bn in (32, 64) for w in (4, 8) for s in (2, 3)]
DECODE_CONFIGS += [(128, w, 2) for w in (4, 8)]
# packed (GQA) programs: (query tokens, BLOCK_N, warps, stages); GQA 32 / 8 packs 4 heads
PACKED_CONFIGS = [(16, 64, 4, 2), (32, 64, 4, 2), (32, 64, 8, 2), (32, 64, 8, 3), (32, 128, 8, 2),
                  (64, 64, 8, 2)]  # fmt: skip


def bench(fn, graph: bool = False) -> float:
    """Median milliseconds of fn()."""
    if graph:
        return do_bench_cudagraph(fn, return_mode="median")
    return do_bench(fn, return_mode="median")


def build(batch_size, seq_len, extend_len, shuffle=False):
    total = batch_size * seq_len
    pool = KVPool(1, total, KV, D, DTYPE, DEV, KERNELS)
    pool.k_buffers[0].normal_()
    pool.v_buffers[0].normal_()
    slots = torch.randperm(total, device=DEV) if shuffle else torch.arange(total, device=DEV)
    table = torch.zeros(batch_size + 1, seq_len, dtype=torch.int32, device=DEV)
    table[:batch_size] = slots.view(batch_size, seq_len).int()
    loc = table[:batch_size, seq_len - extend_len :].reshape(-1).long()
    num_tokens = batch_size * extend_len
    inputs = AttentionInputs(
        req_pool_indices=torch.arange(batch_size, device=DEV),
        seq_lens=torch.full((batch_size,), seq_len, dtype=torch.int64, device=DEV),
        extend_lens=torch.full((batch_size,), extend_len, dtype=torch.int64, device=DEV),
        out_cache_loc=loc,
        seq_lens_cpu=(seq_len,) * batch_size,
        extend_lens_cpu=(extend_len,) * batch_size,
    )
    q = torch.randn(num_tokens, H, D, device=DEV, dtype=DTYPE)
    k = torch.randn(num_tokens, KV, D, device=DEV, dtype=DTYPE)
    v = torch.randn(num_tokens, KV, D, device=DEV, dtype=DTYPE)
    return pool, table, inputs, q, k, v


def time_backend(backend, inputs, q, k, v):
    backend.prepare(inputs)
    return bench(lambda: backend.forward(q, k, v, 0, D**-0.5))


def bench_fa3(pool, table, inputs, q, k, v, add) -> None:
    """The Triton backend with its extend rows on FlashInfer's FA3 prefill (extend_attention
    "fa3"; plan() untimed, as the backends' prepare()), where it runs the model here (its
    kernels are built at the first call, here outside the engine's start-up)."""
    if fa3_cache.unavailable_reason(DEV, D, "bfloat16", False, False) is not None:
        return
    backend = TritonAttentionBackend(pool, table, replace(KERNELS, extend_attention="fa3"))
    name = "flashinfer fa3 extend (store + kernels), eager"
    try:
        add(name, time_backend(backend, inputs, q, k, v))
    except Exception as e:  # e.g. a kernel this FlashInfer build does not have: reported
        print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)


def bench_decode(batch_size, seq_len, rows, shuffle=False, decode_only=False):
    pool, table, inputs, q, k, v = build(batch_size, seq_len, 1, shuffle)
    pool.store(0, inputs.out_cache_loc, k, v)
    k_buf, v_buf = pool.buffers(0)
    gbytes = 2 * batch_size * seq_len * KV * D * k_buf.element_size() / 1e9
    out = torch.empty_like(q)
    workspace = torch.empty(decode_workspace_numel(batch_size, H, D, 32), device=DEV)
    counters = decode_counters(batch_size, KV, DEV)
    name = f"decode {batch_size}x{seq_len}" + (" shuffled" if shuffle else "")

    def kernel(splits, config):
        bn, w, s = config
        return lambda: decode_attention_fwd(
            q, k_buf, v_buf, out, table, inputs.req_pool_indices, inputs.seq_lens, D**-0.5,
            splits, workspace, counters, pdl=KERNELS.pdl, block_n=bn, num_warps=w, num_stages=s,
        )  # fmt: skip

    def add(label, ms):
        rows.append({"case": name, "variant": label, "ms": ms, "TB/s": gbytes / ms})
        print(f"{name:28s} {label:40s} {ms * 1e3:9.1f} us {gbytes / ms:6.2f} TB/s", flush=True)

    backend = TritonAttentionBackend(pool, table, KERNELS)
    backend.prepare(inputs)
    auto_splits = backend._plan.num_kv_splits
    results = {}
    for config in DECODE_CONFIGS:
        results[config] = bench(kernel(auto_splits, config))
        add(f"bn{config[0]} w{config[1]} st{config[2]} splits={auto_splits}", results[config])
    best = min(results, key=results.get)
    print(f"BEST decode {batch_size}x{seq_len} {','.join(map(str, best))}", flush=True)
    if decode_only:
        return
    for splits in (1, 2, 4, 8, 16, 32):
        add(f"best config {best} splits={splits}", bench(kernel(splits, best)))
    default = kernel(auto_splits, (None,) * 3)
    add(f"default kernel, splits={auto_splits}, graph", bench(default, graph=True))
    add("triton backend (store + kernels), eager", time_backend(backend, inputs, q, k, v))
    backend.init_graph_buffers(batch_size)
    backend.load_graph_inputs(inputs, batch_size)
    backend.prepare_graph(batch_size)
    backend.forward(q, k, v, 0, D**-0.5)
    ms = bench(lambda: backend.forward(q, k, v, 0, D**-0.5), graph=True)
    add(f"triton backend graph splits={backend._num_kv_splits(batch_size)}", ms)
    reference = TorchAttentionBackend(pool, table)
    add("torch reference backend", time_backend(reference, inputs, q, k, v))


DECODE_RUN_VARIANTS = {
    "default": {},
    "bn128 w4 st2": {"block_n": 128, "num_warps": 4, "num_stages": 2},
    "bn64 w4 st4": {"block_n": 64, "num_warps": 4, "num_stages": 4},
    # more splits than the backend's: shorter programs, a shorter last wave, partials combined
    "splits 2": {"num_kv_splits": 2},
    "splits 4": {"num_kv_splits": 4},
}


def slot_run(lens: torch.Tensor, layout: str) -> int:
    """Consecutive slots a run of `layout` holds: 1 (random), the longest request (seq), N
    (runs:N)."""
    if layout == "seq":
        return int(lens.max())
    return int(layout.partition(":")[2] or 1)


def decode_slots(lens: torch.Tensor, pool_slots: int, layout: str, gen) -> torch.Tensor:
    """The requests' KV slots, concatenated: `random` scatters every token over the pool;
    `seq` gives each request one run of slots (the runs in random order); `runs:N` runs of N
    slots each, scattered."""
    total = int(lens.sum())
    if layout == "random":
        return torch.randperm(pool_slots, generator=gen)[:total].int()
    run = slot_run(lens, layout)
    num_runs = pool_slots // run
    starts = torch.randperm(num_runs, generator=gen) * run
    slots, used = [], 0
    for n in lens.tolist():
        k = -(-n // run)
        mine = (starts[used : used + k, None] + torch.arange(run)).flatten()[:n]
        slots.append(mine)
        used += k
    return torch.cat(slots).int()


def decode_run_kv(batch_size, mean_len, pool_slots, layers, layout="random", seed=0):
    """Context lengths uniform in [mean_len - 128, mean_len + 128), a pool of `layers` layers of
    noise KV (at least pool_slots slots), and the requests' slots in it by `layout`
    (decode_slots): (lens, pool, req-to-token table on DEV)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    lens = torch.randint(mean_len - 128, mean_len + 128, (batch_size,), generator=gen)
    # room for the runs' rounding
    pool_slots = max(pool_slots, int(lens.sum()) + batch_size * slot_run(lens, layout))
    pool = KVPool(layers, pool_slots, KV, D, DTYPE, DEV)
    for layer in range(layers):
        for buf in pool.buffers(layer):
            buf.normal_()
    slots = decode_slots(lens, pool_slots, layout, gen)
    table = torch.zeros(batch_size + 1, int(lens.max()), dtype=torch.int32)
    for b, row in enumerate(torch.split(slots, lens.tolist())):
        table[b, : len(row)] = row
    return lens, pool, table.to(DEV)


def bench_decode_run(
    batch_size, mean_len, pool_slots, rows, layers=1, seconds=0.0, layout="random"
):
    """Decode as a W1 step sees it: context lengths uniform in [mean_len - 128, mean_len + 128),
    each request's slots drawn at random from a pool of pool_slots (no two alike). The kernel's
    tile configs and split counts as variants (DECODE_RUN_VARIANTS), beside the backend's own.

    With layers > 1 and seconds > 0, each variant runs as a forward would: layer after layer,
    each on its own KV, each after a gate_up and a down matmul of batch_size rows (llama-8b's),
    for `seconds`; the attention alone is timed by CUDA events around it. Back-to-back matmuls
    hold the H200 at its power cap (SM clocks ~1,450 MHz in W1 llama-8b, against 1,980 idle),
    which a lone kernel under do_bench never reaches."""
    lens, pool, table = decode_run_kv(batch_size, mean_len, pool_slots, layers, layout)
    total = int(lens.sum())
    seq_lens = lens.to(DEV)
    pool_idx = torch.arange(batch_size, device=DEV)
    q = torch.randn(batch_size, H, D, device=DEV, dtype=DTYPE)
    out = torch.empty_like(q)
    gbytes = 2 * total * KV * D * DTYPE.itemsize / 1e9
    backend = TritonAttentionBackend(pool, table, KERNELS)
    splits = backend._num_kv_splits(batch_size)
    most = max([splits] + [v.get("num_kv_splits", 1) for v in DECODE_RUN_VARIANTS.values()])
    workspace = torch.empty(decode_workspace_numel(batch_size, H, D, most), device=DEV)
    counters = decode_counters(batch_size, KV, DEV)
    name = f"decode run {batch_size}x~{mean_len} pool {pool.num_slots} {layout}"
    loaded = layers > 1 and seconds > 0
    if loaded:
        name += f", {layers} layers under matmuls"
        matmuls = loaded_matmuls(batch_size)  # built once, shared by the variants
    for label, kwargs in DECODE_RUN_VARIANTS.items():
        kwargs = dict(kwargs)
        n_splits = kwargs.pop("num_kv_splits", splits)

        def attend(layer, kwargs=kwargs, n_splits=n_splits):
            decode_attention_fwd(
                q, *pool.buffers(layer), out, table, pool_idx, seq_lens, D**-0.5, n_splits,
                workspace, counters, pdl=KERNELS.pdl, **kwargs,
            )  # fmt: skip

        if loaded:
            ms = loaded_time(attend, matmuls, layers, seconds)
        else:
            ms = bench(functools.partial(attend, 0))
        rows.append({"case": name, "variant": label, "ms": ms, "TB/s": gbytes / ms})
        print(f"{name:54s} {label:26s} {ms * 1e3:9.1f} us {gbytes / ms:6.2f} TB/s", flush=True)


def loaded_matmuls(batch_size):
    """A gate_up and a down matmul of batch_size rows (llama-8b's shapes), into fixed outputs."""
    hidden, inter = 4096, 14336
    x = torch.randn(batch_size, hidden, device=DEV, dtype=DTYPE)
    w_up = torch.randn(2 * inter, hidden, device=DEV, dtype=DTYPE)
    w_down = torch.randn(hidden, inter, device=DEV, dtype=DTYPE)
    h = torch.empty(batch_size, 2 * inter, device=DEV, dtype=DTYPE)
    y = torch.empty(batch_size, hidden, device=DEV, dtype=DTYPE)

    def run():
        torch.matmul(x, w_up.t(), out=h)
        torch.matmul(h[:, :inter], w_down.t(), out=y)

    return run


def loaded_time(attend, matmuls, layers, seconds) -> float:
    """Mean ms of attend(layer) run layer after layer, each after matmuls(), for `seconds`
    (see bench_decode_run)."""
    events = []
    t0 = time.perf_counter()
    passes = 0
    while time.perf_counter() - t0 < seconds or passes < 2:
        for layer in range(layers):
            matmuls()
            if passes > 0:  # the first pass warms up (compiles, clocks)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                attend(layer)
                end.record()
                events.append((start, end))
            else:
                attend(layer)
        passes += 1
        torch.cuda.synchronize()
    return statistics.mean(s.elapsed_time(e) for s, e in events)


def bench_extend(prefix_len, rows, batch_size=8, extend_len=1024, sweep_only=False):
    seq_len = prefix_len + extend_len
    pool, table, inputs, q, k, v = build(batch_size, seq_len, extend_len)
    pool.store(0, inputs.out_cache_loc, k, v)
    k_buf, v_buf = pool.buffers(0)
    # causal: query j of a request sees prefix_len + j + 1 keys; 2 matmuls of 2 flops per MAC
    keys = batch_size * sum(prefix_len + j + 1 for j in range(extend_len))
    tflop = 4 * keys * H * D / 1e12
    ext = inputs.extend_lens
    start_loc = torch.cumsum(ext, 0) - ext
    out = torch.empty_like(q)
    name = f"extend {batch_size}x{extend_len} prefix {prefix_len}"

    def add(label, ms):
        rows.append({"case": name, "variant": label, "ms": ms, "TFLOP/s": tflop / ms * 1e3})
        print(f"{name:28s} {label:40s} {ms * 1e3:9.1f} us {tflop / ms * 1e3:6.1f} TFLOP/s")

    configs = [
        (f"packed: {bm} tokens bn{bn} w{w} st{st}",
         dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st))
        for bm, bn, w, st in PACKED_CONFIGS
    ]  # fmt: skip
    for label, kwargs in configs:
        fn = functools.partial(
            extend_attention_fwd, q, k_buf, v_buf, out, table, inputs.req_pool_indices,
            inputs.seq_lens, ext, start_loc, extend_len, D**-0.5, **kwargs,
        )  # fmt: skip
        add(label, bench(fn))
    if sweep_only:
        bench_fa3(pool, table, inputs, q, k, v, add)  # page size 1
        return
    triton_backend = TritonAttentionBackend(pool, table, KERNELS)
    add("triton backend (store + kernel)", time_backend(triton_backend, inputs, q, k, v))
    reference = TorchAttentionBackend(pool, table)
    add("torch reference backend", time_backend(reference, inputs, q, k, v))
    bench_fa3(pool, table, inputs, q, k, v, add)  # over the same page-size-1 pool
    if prefix_len == 0:  # the unpaged ceiling: torch SDPA (flash) on contiguous tensors
        qc = q.view(batch_size, extend_len, H, D).transpose(1, 2).contiguous()
        kc = k.view(batch_size, extend_len, KV, D).transpose(1, 2).repeat_interleave(H // KV, 1)
        vc = v.view(batch_size, extend_len, KV, D).transpose(1, 2).repeat_interleave(H // KV, 1)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        add("torch SDPA contiguous (no paging)", bench(lambda: sdpa(qc, kc, vc, is_causal=True)))


def copy_bandwidth() -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return 2 * src.numel() / bench(functools.partial(dst.copy_, src)) / 1e9


@triton.jit
def _read_kernel(X, Out, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    x = tl.load(X + pid * BLOCK + tl.arange(0, BLOCK))
    tl.store(Out + pid, tl.sum(x.to(tl.float32)))


def read_bandwidth(gib: int = 4, block: int = 8192) -> float:
    """TB/s of a streaming read (each program sums 16 KB of bf16; one float written a program):
    the ceiling a read-only kernel such as the decode attention can reach, which a copy's
    (reads and writes) may understate."""
    x = torch.ones((gib << 30) // 2, dtype=DTYPE, device=DEV)
    out = torch.empty(x.numel() // block, device=DEV)
    ms = bench(lambda: _read_kernel[(out.numel(),)](x, out, BLOCK=block, num_warps=8))
    return x.numel() * 2 / ms / 1e9


def summarize(rows: list[dict]) -> None:
    print("\nsummary: best Triton variant per case vs the torch reference (and FlashInfer)")
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [
            r for r in rows if r["case"] == case and not r["variant"].startswith(("torch", "flash"))
        ]
        best = min(mine, key=lambda r: r["ms"])
        ref = next(r for r in rows if r["case"] == case and r["variant"].startswith("torch ref"))
        unit = "TB/s" if "TB/s" in best else "TFLOP/s"
        fi = [r for r in rows if r["case"] == case and r["variant"].startswith("flash")]
        fi_best = min(fi, key=lambda r: r["ms"]) if fi else None
        print(
            f"{case:28s} best {best['ms'] * 1e3:8.1f} us {best[unit]:6.2f} {unit} "
            f"({best['variant']}) | torch ref {ref['ms'] * 1e3:9.1f} us {ref[unit]:6.2f} {unit}"
            + (f" | flashinfer {fi_best['ms'] * 1e3:8.1f} us" if fi_best else "")
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write all rows here")
    parser.add_argument(
        "--decode-cases",
        default=None,
        help="BxL,...: only the decode config sweep, for these batch x context sizes",
    )
    parser.add_argument(
        "--decode-run",
        default=None,
        help="BxL[:POOL[:LAYOUT]],...: only decode as a W1 step sees it (ragged lengths around "
        "L, slots over a pool of POOL slots: LAYOUT random (default), seq or runs:N, see "
        "decode_slots), by tile config and split count",
    )
    parser.add_argument(
        "--loaded",
        default=None,
        help="LAYERS:SECONDS: with --decode-run, time each variant layer after layer between "
        "matmuls, at the power cap a forward holds (see bench_decode_run)",
    )
    parser.add_argument(
        "--extend-cases",
        default=None,
        help="BxE[+P],...: only the extend config sweep, B requests of E new tokens over a "
        "P-token prefix (W1's mixed steps: 16x512)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention_kernels: needs a CUDA GPU (the kernels are Triton's)")
        return
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    print(f"device-to-device copy: {copy_bandwidth():.2f} TB/s (bytes read + written)")
    print(f"streaming read: {read_bandwidth():.2f} TB/s")
    rows: list[dict] = []
    for case in args.extend_cases.split(",") if args.extend_cases else ():
        shape, _, prefix = case.partition("+")
        batch_size, extend_len = (int(x) for x in shape.split("x"))
        bench_extend(int(prefix or 0), rows, batch_size, extend_len, sweep_only=True)
    layers, _, seconds = (args.loaded or "1:0").partition(":")
    for case in args.decode_run.split(",") if args.decode_run else ():
        shape, _, rest = case.partition(":")
        pool, _, layout = rest.partition(":")
        batch_size, mean_len = (int(x) for x in shape.split("x"))
        bench_decode_run(
            batch_size, mean_len, int(pool or 0), rows, int(layers), float(seconds or 0),
            layout or "random",
        )  # fmt: skip
    if args.extend_cases or args.decode_run:
        return
    if args.decode_cases:
        for case in args.decode_cases.split(","):
            batch_size, seq_len = (int(x) for x in case.split("x"))
            bench_decode(batch_size, seq_len, rows, decode_only=True)
        return
    for batch_size, seq_len in ((64, 1024), (256, 512), (1, 512)):
        bench_decode(batch_size, seq_len, rows)
    bench_decode(64, 1024, rows, shuffle=True)
    for prefix_len in (0, 1024):
        bench_extend(prefix_len, rows)

    summarize(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
