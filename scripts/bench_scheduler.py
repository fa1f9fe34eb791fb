"""Host cost of the scheduler per step, on the CPU, without a model: the real Scheduler,
KVManager, TokenAllocator, RadixCache and ReqToTokenPool driven through a W4-like workload
(1,000 requests x 512 prompt tokens, 256 output tokens each, max_running 256, chunk 4,096).

    python scripts/bench_scheduler.py                   # W4 shape, median of 3 runs
    python scripts/bench_scheduler.py --num-requests 300 --repeats 1 --digest

The loop is Engine.step's with overlap (as on CUDA): schedule(n+1) -> advance(n+1) -> process(n),
where process sets the sampled ids over the placeholders and finishes the requests that reached
max_new_tokens (scheduler.finish). Request-to-token writes are queued as on CUDA and discarded
(take_pending) after each schedule. Prints microseconds per step of schedule / advance / finish
(finish: the scheduler.finish calls of a step; process: the whole simulated result loop): means
over all steps, and medians per kind of step (decode-only; prefill chunks beside at least
max_running / 2 decodes, W4's admission waves; prefill with fewer decodes). The default pool
(1M tokens) never evicts, like the H200's; a smaller --kv-budget times eviction too. --digest
prints a hash of every batch (requests, lengths, ids, positions, slots, sample mask) to compare
the decisions of two versions of the scheduler.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import random
import statistics
import time

import torch
from benchlib import TOKEN_HIGH, TOKEN_LOW, random_tokens

from batchrun.engine.allocator import TokenAllocator
from batchrun.engine.kv_manager import KVManager
from batchrun.engine.kv_pool import ReqToTokenPool
from batchrun.engine.radix_cache import RadixCache
from batchrun.engine.request import Req
from batchrun.engine.scheduler import ScheduledBatch, Scheduler
from batchrun.params import SamplingParams

# kinds of steps timed apart (W4's steady state: a wave of 8 admissions beside ~248 decodes,
# then decode-only steps until the wave's requests finish)
KINDS = {
    "decode": "decode-only",
    "mixed": "prefill + decodes",  # at least max_running / 2 decodes
    "prefill": "prefill, fewer decodes",
}


def make_scheduler(args: argparse.Namespace) -> Scheduler:
    context = args.prompt_len + args.output_len + 64
    allocator = TokenAllocator(args.kv_budget, args.page_size)
    cache = RadixCache(allocator, args.page_size, disable=args.no_radix)
    req_pool = ReqToTokenPool(args.max_running, context, "cpu")
    req_pool._deferred = not args.direct_writes  # queue writes as on CUDA (the GPU's hot path)
    kv = KVManager(allocator, cache, req_pool)
    return Scheduler(kv, args.max_running, args.chunk, args.new_token_ratio)


def batch_digest(batch: ScheduledBatch) -> bytes:
    parts = (
        [(r.rid, r.index) for r in batch.reqs],
        batch.extend_lens,
        batch.prefix_lens,
        batch.input_ids,
        batch.positions,
        batch.out_cache_loc.tolist(),
        batch.sample_mask,
    )
    return repr(parts).encode()


def run_once(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    sched = make_scheduler(args)
    params = SamplingParams(max_new_tokens=args.output_len, ignore_eos=True)
    for i, ids in enumerate(prompts):
        sched.add(Req(str(i), 0, list(ids), params, seed=i, arrival=i + 1))
    pool = sched.kv.req_pool
    clock = time.perf_counter_ns
    t_sched: dict[str, list[int]] = {kind: [] for kind in KINDS}
    t_adv: dict[str, list[int]] = {kind: [] for kind in KINDS}
    t_finish: list[int] = []
    t_process: list[int] = []
    digest = hashlib.sha256() if args.digest else None
    inflight: list[tuple[Req, int]] | None = None
    finish_ns = 0

    def finish(req: Req) -> None:
        nonlocal finish_ns
        t = clock()
        sched.finish(req)
        finish_ns += clock() - t

    def process(launched: list[tuple[Req, int]]) -> None:
        # Engine._process without the model: ids for the placeholders, "length" finishes
        for req, idx in launched:
            if req.is_finished:
                continue
            req.num_inflight -= 1
            req.output_ids[idx] = TOKEN_LOW + (req.arrival * 7919 + idx) % (TOKEN_HIGH - TOKEN_LOW)
            if idx + 1 >= req.params.max_new_tokens:
                req.finish_reason = "length"
                del req.output_ids[idx + 1 :]
                req.num_inflight = 0
                finish(req)

    num_steps = 0
    gc.collect()
    start = time.perf_counter()
    while sched.has_work or inflight is not None:
        t0 = clock()
        batch = sched.schedule()
        t1 = clock()
        if batch is None and sched.needs_sync and inflight is not None:
            process(inflight)
            inflight = None
            t0 = clock()
            batch = sched.schedule()
            t1 = clock()
        sched.drain_aborted()
        pool.take_pending()
        launched = None
        if batch is not None:
            num_decodes = sum(1 for n in batch.extend_lens if n == 1)
            if num_decodes == len(batch.reqs):
                kind = "decode"
            elif 2 * num_decodes >= args.max_running:
                kind = "mixed"
            else:
                kind = "prefill"
            if digest is not None:
                digest.update(batch_digest(batch))
            launched = [(r, len(r.output_ids)) for r, s in zip(batch.reqs, batch.sample_mask) if s]
            t2 = clock()
            sched.advance(batch)
            t3 = clock()
            t_sched[kind].append(t1 - t0)
            t_adv[kind].append(t3 - t2)
            num_steps += 1
        finish_ns = 0
        t4 = clock()
        if inflight is not None:
            process(inflight)
            inflight = None
        if launched is not None:
            if args.no_overlap:
                process(launched)
            else:
                inflight = launched
        if batch is not None:
            t_process.append(clock() - t4)
            t_finish.append(finish_ns)
        elif not sched.running and sched.waiting and inflight is None:
            raise RuntimeError("the head of the queue can never be scheduled")
    wall = time.perf_counter() - start
    sched.kv.check_integrity()
    return {
        "steps": num_steps,
        "wall_s": wall,
        "sched": t_sched,
        "adv": t_adv,
        "finish": t_finish,
        "process": t_process,
        "retractions": sched.num_retractions,
        "digest": digest.hexdigest()[:16] if digest is not None else None,
    }


def mean_us(values: list[int]) -> float:
    return sum(values) / len(values) / 1e3 if values else float("nan")


def summarize(res: dict) -> dict[str, float]:
    sched, adv = res["sched"], res["adv"]
    all_sched = [t for kind in KINDS for t in sched[kind]]
    all_adv = [t for kind in KINDS for t in adv[kind]]
    out = {
        "schedule": mean_us(all_sched),
        "advance": mean_us(all_adv),
        "finish": mean_us(res["finish"]),
        "process": mean_us(res["process"]),
    }
    out["sum"] = out["schedule"] + out["advance"] + out["finish"]
    # per kind of step: medians (robust to the odd GC pause on a busy host)
    for kind in KINDS:
        out[f"sched_{kind}"] = median_us(sched[kind])
        out[f"adv_{kind}"] = median_us(adv[kind])
    return out


def median_us(values: list[int]) -> float:
    return statistics.median(values) / 1e3 if values else float("nan")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument(
        "--kv-budget",
        type=int,
        default=1_000_000,
        help="KV pool size in tokens (1M: no eviction, as on the H200)",
    )
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--new-token-ratio", type=float, default=0.4)
    p.add_argument("--no-radix", action="store_true")
    p.add_argument("--no-overlap", action="store_true")
    p.add_argument("--direct-writes", action="store_true", help="CPU table writes, not queued")
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens all prompts start with")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--digest", action="store_true", help="print a hash of every batch")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    head = random_tokens(rng, args.shared_prefix)
    prompts = [
        head + random_tokens(rng, args.prompt_len - len(head)) for _ in range(args.num_requests)
    ]
    res = [run_once(args, prompts) for _ in range(args.repeats)]
    runs = [summarize(r) for r in res]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    last = res[-1]
    by_kind = "/".join(str(len(last["sched"][kind])) for kind in KINDS)
    print(
        f"{args.num_requests} requests x {args.prompt_len} in, {args.output_len} out, "
        f"max_running {args.max_running}, chunk {args.chunk}, page {args.page_size}, "
        f"radix {'off' if args.no_radix else 'on'}: {last['steps']} steps "
        f"({by_kind} {'/'.join(KINDS)}), {last['retractions']} retractions, "
        f"{statistics.median(r['wall_s'] for r in res):.2f} s per run"
    )
    print(f"us per step, median of {args.repeats} runs:")
    print(
        f"  mean, all steps                 schedule {med['schedule']:7.1f}  "
        f"advance {med['advance']:6.1f}  finish {med['finish']:5.1f}  sum {med['sum']:7.1f}  "
        f"(engine-like process {med['process']:.1f})"
    )
    for kind, label in KINDS.items():
        print(
            f"  median, {label:23s} schedule {med[f'sched_{kind}']:7.1f}  "
            f"advance {med[f'adv_{kind}']:6.1f}"
        )
    if args.digest:
        print(f"digest {last['digest']}")


if __name__ == "__main__":
    main()
