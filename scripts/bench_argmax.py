"""Greedy sampling's argmax by row count: torch's `argmax(-1)` against kernels/argmax.py on
[rows, vocab] logits (µs per call, CUDA events, median of 5 runs of --iters calls, each call on
its own logits tensor so that the L2 holds none of them). A plain loop, no graph: where the
host's side of a call (the kernel's allocations and two Triton launches, ~50 µs) is longer
than the device's, the figure is the host's; the engine's step trace is the measure that
counts (docs/benchmarks.md, fifteenth session).

    python scripts/bench_argmax.py --rows 1,16,64,256,512,1024 --vocab 128256
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from batchrun.kernels.argmax import argmax  # noqa: E402
from cuda_timing import cycled_time_us  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", default="1,16,64,256,512,1024")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--chunks", default="2048,4096,8192", help="kernels/argmax.py ids a program")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    dtype = getattr(torch, args.dtype)
    print(f"argmax over [rows, {args.vocab}] {args.dtype}: µs per call (GB/s of logits read)")
    chunks = [int(c) for c in args.chunks.split(",")]
    print("rows | torch | " + " | ".join(f"argmax.py, chunk {c}" for c in chunks) + " | same ids")
    for rows in (int(r) for r in args.rows.split(",")):
        copies = max(2, (256 << 20) // (rows * args.vocab * dtype.itemsize) + 1)
        inputs = [torch.randn(rows, args.vocab, device="cuda", dtype=dtype) for _ in range(copies)]
        fns = [lambda x: x.argmax(-1)] + [functools.partial(argmax, chunk=c) for c in chunks]
        same = all(torch.equal(x.argmax(-1), fn(x)) for x in inputs[:2] for fn in fns[1:])
        nbytes = rows * args.vocab * dtype.itemsize
        cells = []
        for fn in fns:
            us = cycled_time_us(fn, inputs, args.iters)
            cells.append(f"{us:.1f} ({nbytes / us / 1e3:.0f})")
        print(f"{rows} | " + " | ".join(cells) + f" | {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
