"""A decode CUDA graph's inputs in one kernel: the step's token ids (the ones the previous step
sampled still on the device, read from the token pool), positions and attention inputs, copied
from the step's packed device tensors into the graph's static buffers, padding rows included.

Without it, a batch-1 decode step runs seven small operations outside its graph for this: the
placeholder gather and scatter (two index kernels), five device-to-device copies (ids,
positions, request rows, sequence lengths, cache slots); each costs its launch and a kernel
boundary, a visible share of a small model's batch-1 step (docs/benchmarks.md, Kernels).

    load_decode_graph_inputs(src, dst, token_pool, n, pad_row, pad_slot)

src = (ids, positions, req_rows, seq_lens, out_loc), n entries each (int64; an id < 0 is a
placeholder: the request's latest sampled token, token_pool[req_row]); dst = the same five
static buffers, of which [0, bs) are written: rows [n, bs) get id 0, position 0, the dummy
request row `pad_row`, seq_len 1 and the dummy KV slot `pad_slot` (the padding rule of
batchrun/attention/triton_backend.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# NOTE: one compiled variant for every step: Triton specializes integer arguments (== 1, multiples
# of 16) and a constexpr block per batch size would compile more; a variant first met mid-run
# compiles inside the timed region (docs/benchmarks.md, Kernels)
BLOCK = 256


@triton.jit(do_not_specialize=["n", "bs", "pad_row", "pad_slot"])
def _load_decode_graph_inputs_kernel(
    Ids,
    Pos,
    Rows,
    SeqLens,
    OutLoc,
    TokenPool,
    GIds,
    GPos,
    GRows,
    GSeqLens,
    GOutLoc,
    n,
    bs,
    pad_row,
    pad_slot,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    real = offs < n
    graph = offs < bs
    ids = tl.load(Ids + offs, mask=real, other=0)
    rows = tl.load(Rows + offs, mask=real, other=pad_row)
    sampled = tl.load(TokenPool + rows, mask=real & (ids < 0), other=0)
    tl.store(GIds + offs, tl.where(ids < 0, sampled, ids), mask=graph)
    tl.store(GPos + offs, tl.load(Pos + offs, mask=real, other=0), mask=graph)
    tl.store(GRows + offs, rows, mask=graph)
    tl.store(GSeqLens + offs, tl.load(SeqLens + offs, mask=real, other=1), mask=graph)
    tl.store(GOutLoc + offs, tl.load(OutLoc + offs, mask=real, other=pad_slot), mask=graph)


def load_decode_graph_inputs(
    src: tuple[torch.Tensor, ...],
    dst: tuple[torch.Tensor, ...],
    token_pool: torch.Tensor,
    n: int,
    bs: int,
    pad_row: int,
    pad_slot: int,
) -> None:
    """dst[i][:bs] <- src[i][:n], padded (see the module docstring); ids resolved."""
    assert len(src) == len(dst) == 5 and 0 < n <= bs
    for t in (*src, *dst, token_pool):
        assert t.dtype == torch.int64 and t.dim() == 1 and t.stride(0) == 1
    assert all(t.shape[0] >= n for t in src) and all(t.shape[0] >= bs for t in dst)
    _load_decode_graph_inputs_kernel[(triton.cdiv(bs, BLOCK),)](
        *src, token_pool, *dst, n, bs, pad_row, pad_slot, BLOCK=BLOCK, num_warps=4
    )
