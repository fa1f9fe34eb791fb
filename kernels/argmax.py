"""Greedy argmax over a large vocabulary, each row split across the GPU.

torch's `logits.argmax(-1)` on [1, 128256] bf16 logits is one reduction kernel: a single row
leaves it one block, a visible share of a small model's decode step. This kernel is faster at
one row and at W1's batch sizes too (docs/benchmarks.md, Kernels). Here stage 1 gives
each (row, chunk of CHUNK ids) a program that writes the chunk's max and the lowest id reaching
it; stage 2 takes, per row, the first chunk holding the row's max. So ties resolve to the lowest
id, as torch's argmax does.

    ids = argmax(logits)        # [S] int64; logits [S, V], any float dtype, no NaN (-inf ok)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchrun.kernels.pdl import pdl_launch_kwargs, pdl_wait

CHUNK = 2048  # 63 programs per row for a 128k vocabulary


@triton.jit
def _argmax_chunks_kernel(
    Logits,
    Vals,
    Idx,
    stride_row,
    vocab_size,
    num_chunks,
    CHUNK_SIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # every input is an earlier kernel's output
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    x = tl.load(Logits + row * stride_row + offs, mask=offs < vocab_size, other=float("-inf")).to(
        tl.float32
    )
    best = tl.max(x, axis=0)
    first = tl.argmax(x, axis=0)  # the lowest index of the max within the chunk
    tl.store(Vals + row * num_chunks + chunk, best)
    tl.store(Idx + row * num_chunks + chunk, chunk * CHUNK_SIZE + first)


@triton.jit
def _argmax_rows_kernel(Vals, Idx, Out, num_chunks, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # every input is an earlier kernel's output
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < num_chunks
    vals = tl.load(Vals + row * num_chunks + offs, mask=mask, other=float("-inf"))
    pick = tl.argmax(vals, axis=0)  # the first chunk holding the max: lowest ids win ties
    tl.store(Out + row, tl.load(Idx + row * num_chunks + pick).to(tl.int64))


def argmax(logits: torch.Tensor, chunk: int = CHUNK, *, pdl: bool = False) -> torch.Tensor:
    """Each row's argmax, [S] int64 (the lowest id among equal maxima); `chunk` ids a program
    (a power of two). pdl: launched with programmatic dependent launch (kernels/pdl.py)."""
    num_rows, vocab_size = logits.shape
    assert logits.stride(-1) == 1
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    num_chunks = triton.cdiv(vocab_size, chunk)
    vals = torch.empty((num_rows, num_chunks), dtype=torch.float32, device=logits.device)
    idx = torch.empty((num_rows, num_chunks), dtype=torch.int32, device=logits.device)
    launch = pdl_launch_kwargs(pdl, logits)
    _argmax_chunks_kernel[(num_rows, num_chunks)](
        logits, vals, idx, logits.stride(0), vocab_size, num_chunks, CHUNK_SIZE=chunk,
        num_warps=4, **launch,
    )  # fmt: skip
    _argmax_rows_kernel[(num_rows,)](
        vals, idx, out, num_chunks, BLOCK=triton.next_power_of_2(num_chunks),
        num_warps=1, **launch,
    )  # fmt: skip
    return out
