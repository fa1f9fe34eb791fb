"""Time and memory of the duplicate-id set (batchrun.io.id_set.IdSet) for N ids.

    python scripts/bench_duplicate_ids.py                       # 100M ids, table only (below)
    python scripts/bench_duplicate_ids.py --num 10000000 --strings  # 10M string ids, hashed
    python scripts/bench_duplicate_ids.py --num 20000 --json    # one JSON line (the smoke test)
    python scripts/bench_duplicate_ids.py --num 0 --openai-rows 300000   # the OpenAI Batch pass

Id i is the string "req-<i>"; one id in --dup-every repeats the id 1,000 before it, so the run
also checks that exactly those are found, each with its first row. Default: the set is fed
the 96-bit hashes of ids generated in numpy (SplitMix64 of i), which times the table alone
(probing, growth) without spending minutes building 100M Python strings; BLAKE2b on
--hash-sample real string ids gives the hashing rate, and `total_us_per_id` adds the two.
--strings feeds every id as a string through IdSet.add (hashing included). --batch-size: 8192
is the OpenAI Batch pre-pass's batch, 256 the row pipeline's. Peak memory is the process's peak
RSS (ru_maxrss), the interpreter and numpy included. --openai-rows N also writes N OpenAI Batch
request lines of ~780 bytes to a temporary JSONL file and times the pass over their custom_ids
that runs before the model loads (batchrun.job.pipeline.openai_duplicates) against reading the
same rows whole (read_rows).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from batchrun.io.id_set import IdSet, hash_ids
from batchrun.io.readers import open_dataset
from batchrun.job.pipeline import openai_duplicates, read_rows

GiB = 2**30
DUP_DISTANCE = 1000


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB  # KiB on Linux


def splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def id_numbers(start: int, end: int, dup_every: int) -> np.ndarray:
    """The id number of rows start..end-1: row i has id i, except each dup_every-th row."""
    ids = np.arange(start, end, dtype=np.int64)
    dup = (ids % dup_every == dup_every - 1) & (ids >= DUP_DISTANCE)
    ids[dup] -= DUP_DISTANCE
    return ids


def openai_pass(num_rows: int) -> dict:
    """Seconds a row of the custom_id pass and of a whole read, over `num_rows` request lines."""
    words = "lorem ipsum dolor sit amet " * 15
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "batch.jsonl"
        with open(path, "w") as f:
            for i in range(num_rows):
                body = {
                    "model": "gpt-4o-mini",
                    "messages": [
                        {"role": "system", "content": "You are a helpful assistant. " * 3},
                        {"role": "user", "content": f"Summarize in one sentence: {i} {words}"},
                    ],
                    "max_tokens": 256,
                    "temperature": 0.2,
                }
                line = {
                    "custom_id": f"request-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                }
                f.write(json.dumps({**line, "body": body}) + "\n")
        source = open_dataset(path)
        t = time.perf_counter()
        assert openai_duplicates(source, None) is None
        pass_s = time.perf_counter() - t
        t = time.perf_counter()
        assert sum(len(b) for b in read_rows(source, None, 8192)) == num_rows
        read_s = time.perf_counter() - t
        return {
            "openai_rows": num_rows,
            "openai_bytes_per_row": round(path.stat().st_size / max(num_rows, 1)),
            "openai_pass_us_per_row": round(pass_s / max(num_rows, 1) * 1e6, 2),
            "whole_read_us_per_row": round(read_s / max(num_rows, 1) * 1e6, 2),
        }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num", type=int, default=100_000_000)
    p.add_argument("--batch-size", type=int, default=8192)
    p.add_argument("--dup-every", type=int, default=10_000)
    p.add_argument("--strings", action="store_true", help="feed string ids (hashing included)")
    p.add_argument("--hash-sample", type=int, default=1_000_000)
    p.add_argument("--openai-rows", type=int, default=0, help="also time the OpenAI Batch pass")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    args = p.parse_args(argv)

    rss_start = peak_rss_gib()
    ids = IdSet()
    found = 0
    make_s = add_s = 0.0
    for start in range(0, args.num, args.batch_size):
        end = min(start + args.batch_size, args.num)
        t = time.perf_counter()
        numbers = id_numbers(start, end, args.dup_every)
        rows = np.arange(start, end, dtype=np.int64)
        if args.strings:
            batch = [f"req-{n}" for n in numbers.tolist()]
        else:
            key = splitmix64(numbers) | np.uint64(1)
            check = (splitmix64(numbers ^ 0x5DEECE66D) >> np.uint64(32)).astype(np.uint32)
        t2 = time.perf_counter()
        if args.strings:
            first = ids.add(batch, rows)
        else:
            first = ids.add_hashed(key, check, rows)
        add_s += time.perf_counter() - t2
        make_s += t2 - t
        repeats = numbers != rows
        # every repeat is found with its first row (the id's own number), nothing else is
        assert (first[repeats] == numbers[repeats]).all() and (first[~repeats] == -1).all()
        found += int(repeats.sum())

    sample = [f"req-{i}" for i in range(args.hash_sample)]
    t = time.perf_counter()
    hash_ids(sample)
    hash_us = (time.perf_counter() - t) / max(args.hash_sample, 1) * 1e6
    add_us = add_s / max(args.num, 1) * 1e6
    result = {
        "num_ids": args.num,
        "duplicates_found": found,
        "batch_size": args.batch_size,
        "strings": args.strings,
        "add_s": round(add_s, 2),
        "add_us_per_id": round(add_us, 3),
        "hash_us_per_id": round(hash_us, 3),
        "total_us_per_id": round(add_us if args.strings else add_us + hash_us, 3),
        "make_input_s": round(make_s, 2),
        "table_gib": round(ids.nbytes / GiB, 3),
        "capacity": ids.capacity,
        "load": round(len(ids) / ids.capacity, 3),
        "peak_rss_gib": round(peak_rss_gib(), 3),
        "peak_rss_before_gib": round(rss_start, 3),
    }
    if args.openai_rows:
        result.update(openai_pass(args.openai_rows))
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:22s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
