"""Time and memory of prefix ordering (batchrun.job.order) on synthetic token-id prompts.

    python scripts/bench_order.py                       # 1,000,000 prompts of ~300 tokens
    python scripts/bench_order.py --num 100000 --json   # one JSON line (used by the slow test)

Prompts: --groups prefix groups, each a random shared prefix of 100-250 tokens, plus a random
tail of 60-190 tokens per prompt (mean ~300 tokens), shuffled, stored flat (uint32 tokens +
offsets: the input itself costs 4 bytes per token). Timed: building the sort keys and the DFS
order (what a run does per window), then the per-prompt reusable prefix (what `plan` adds).
Peak memory is the process's peak RSS (ru_maxrss), input included.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import numpy as np

from batchrun.job.order import dfs_order, packed_keys, reuse_lens

GiB = 2**30


def make_prompts(num: int, groups: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(tokens uint32 [total], offsets int64 [num + 1]) of shuffled shared-prefix prompts."""
    rng = np.random.default_rng(seed)
    max_prefix = 250
    prefixes = rng.integers(3, 128_000, (groups, max_prefix), dtype=np.uint32)
    prefix_len = rng.integers(100, max_prefix + 1, groups)
    group = rng.integers(0, groups, num)
    lens = prefix_len[group] + rng.integers(60, 191, num)
    offsets = np.zeros(num + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    tokens = np.empty(int(offsets[-1]), dtype=np.uint32)
    chunk = 32_768
    width = int(lens.max())
    cols = np.arange(width)
    for start in range(0, num, chunk):
        end = min(start + chunk, num)
        g = group[start:end]
        rows = rng.integers(3, 128_000, (end - start, width), dtype=np.uint32)
        # the first prefix_len tokens of a prompt are its group's prefix
        head = rows[:, :max_prefix]
        in_prefix = cols[None, :max_prefix] < prefix_len[g][:, None]
        head[in_prefix] = prefixes[g][in_prefix]
        mask = cols[None, :] < lens[start:end][:, None]
        tokens[offsets[start] : offsets[end]] = rows[mask]  # row-major: prompt after prompt
    return tokens, offsets


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB  # KiB on Linux


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num", type=int, default=1_000_000)
    p.add_argument("--groups", type=int, default=10_000)
    p.add_argument("--no-reuse", action="store_true", help="skip the reusable-prefix pass")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    args = p.parse_args(argv)

    t = time.perf_counter()
    tokens, offsets = make_prompts(args.num, args.groups)
    gen_s = time.perf_counter() - t
    input_gib = (tokens.nbytes + offsets.nbytes) / GiB
    rss_input = peak_rss_gib()

    t = time.perf_counter()
    keys = packed_keys(tokens, offsets)
    keys_s = time.perf_counter() - t
    t = time.perf_counter()
    order = dfs_order(keys)
    sort_s = time.perf_counter() - t
    rss_order = peak_rss_gib()
    result = {
        "num_prompts": args.num,
        "tokens": int(len(tokens)),
        "mean_len": len(tokens) / args.num,
        "generate_s": round(gen_s, 2),
        "keys_s": round(keys_s, 2),
        "sort_s": round(sort_s, 2),
        "order_s": round(keys_s + sort_s, 2),
        "input_gib": round(input_gib, 3),
        "peak_rss_before_order_gib": round(rss_input, 3),
        "peak_rss_gib": round(rss_order, 3),
    }
    # spot check: the order is sorted
    for i in np.random.default_rng(1).integers(1, args.num, 1000):
        assert keys[order[i - 1]] <= keys[order[i]]
    if not args.no_reuse:
        t = time.perf_counter()
        sorted_keys = [keys[i] for i in order]
        reuse = reuse_lens(sorted_keys)
        result["reuse_s"] = round(time.perf_counter() - t, 2)
        result["reusable_fraction"] = round(float(reuse.sum()) / len(tokens), 4)
        result["peak_rss_with_reuse_gib"] = round(peak_rss_gib(), 3)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:28s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
