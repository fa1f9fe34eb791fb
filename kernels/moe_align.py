"""The routed tokens of a mixture-of-experts layer sorted by expert and padded to whole blocks,
on the device and without a host sync (kernels/fused_moe.py's grouped GEMMs read this layout):

    topk_ids [T, k]          flat row r = t * k + j routes token t to expert topk_ids[t, j]

    sorted_ids   [S]         the rows r grouped by expert (ascending r within an expert), each
                             expert's group padded with the sentinel T * k to a multiple of
                             BLOCK_M; the groups in expert order
    expert_ids   [S / BLOCK_M]   the expert of each block of sorted_ids
    num_padded   [1]         the padded length actually used (the blocks past it are not written)

    sorted_ids:  | e0 e0 e0 pad | e2 pad pad pad | e5 e5 e5 e5 e5 pad pad pad | (unused) ... |
                 |<- block 0 ->|<-- block 1 -->|<---- blocks 2 and 3 ------->|
                                                                  num_padded ^

Only the experts that receive rows get blocks, so a decode batch's GEMMs read only the experts
it touches. The buffers are sized by shape alone (`max_blocks`), so the step can run inside a
CUDA graph: each expert with rows wastes fewer than BLOCK_M slots, and every block holds at least
one row, so the blocks number at most min(N, N / BLOCK_M + min(E, N)) for N = T * k rows.

One kernel launch, one program per expert. Each program scans all N expert ids twice, 1024 a
step (2048 past 8192 rows): first a histogram of every expert's rows (for the padded start of
its own group), then the scatter of its own rows, ranked by a cumulative sum. That is E * N
reads from L2 (128 experts x 131,072 rows: 64 MB, 2 x 64 steps per program), small beside the
GEMMs that follow, and one launch where a torch chain of sort, cumsum, searchsorted and scatter
takes a dozen (a decode step runs the MoE of every layer).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# expert ids per step of a program's scans: two sizes, so that few variants compile
SCAN, LONG_SCAN, LONG_ROWS = 1024, 2048, 8192


class Alignment(NamedTuple):
    sorted_ids: torch.Tensor  # int32 [max_blocks * block_m]
    expert_ids: torch.Tensor  # int32 [max_blocks]
    num_padded: torch.Tensor  # int32 [1]
    ends: torch.Tensor | None = None  # int32 [E], each expert's group end (align_by_expert's ends)


def max_blocks(num_rows: int, num_experts: int, block_m: int) -> int:
    """The most blocks of block_m rows that num_rows routed rows can fill (module docstring)."""
    return min(num_rows, num_rows // block_m + min(num_experts, num_rows))


@triton.jit
def _align_kernel(
    TopkIds,  # int32 / int64 [N], the flattened [T, k]
    SortedIds,  # int32 [max_blocks * BLOCK_M]
    ExpertIds,  # int32 [max_blocks]
    NumPadded,  # int32 [1]
    Ends,  # WRITE_ENDS: int32 [E], each expert's group end (the padded rows before it and its own)
    N,  # T * k: the rows, and the sentinel of padding slots
    E: tl.constexpr,
    NUM_BINS: tl.constexpr,  # a power of two > E: bin E takes the masked lanes
    BLOCK_M: tl.constexpr,
    SCAN: tl.constexpr,
    WRITE_ENDS: tl.constexpr,
):
    expert = tl.program_id(0)
    offs = tl.arange(0, SCAN)
    bins = tl.arange(0, NUM_BINS)

    counts = tl.zeros((NUM_BINS,), dtype=tl.int32)
    for start in range(0, N, SCAN):
        ids = tl.load(TopkIds + start + offs, mask=start + offs < N, other=E).to(tl.int32)
        counts += tl.histogram(ids, NUM_BINS)
    counts = tl.where(bins < E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    group_start = tl.sum(tl.where(bins < expert, padded, 0))
    group_rows = tl.sum(tl.where(bins == expert, counts, 0))
    group_len = tl.sum(tl.where(bins == expert, padded, 0))
    if WRITE_ENDS:
        tl.store(Ends + expert, group_start + group_len)

    # this expert's rows in ascending order, then the sentinel in its padding
    ranked = group_start
    for start in range(0, N, SCAN):
        rows = start + offs
        ids = tl.load(TopkIds + rows, mask=rows < N, other=E).to(tl.int32)
        mine = ids == expert
        rank = tl.cumsum(mine.to(tl.int32), 0)
        tl.store(SortedIds + ranked + rank - 1, rows, mask=mine)
        ranked += tl.sum(mine.to(tl.int32))
    pad = tl.arange(0, BLOCK_M)
    tl.store(SortedIds + ranked + pad, N + pad * 0, mask=pad < group_len - group_rows)

    first_block = group_start // BLOCK_M
    for b in range(0, group_len // BLOCK_M, SCAN):
        tl.store(
            ExpertIds + first_block + b + offs,
            expert + offs * 0,
            mask=b + offs < group_len // BLOCK_M,
        )
    if expert == 0:
        tl.store(NumPadded, tl.sum(padded))


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, ends: bool = False
) -> Alignment:
    """topk_ids [T, k] (int32 or int64, values in [0, num_experts)) sorted and block-aligned by
    expert as the module docstring draws it; no host sync, buffers sized by shape. `ends`: also
    each expert's group end, the cumulative padded lengths (torch._grouped_mm's offsets)."""
    num_rows = topk_ids.numel()
    blocks = max_blocks(num_rows, num_experts, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    expert_ids = torch.empty(blocks, dtype=torch.int32, device=device)
    num_padded = torch.zeros(1, dtype=torch.int32, device=device)
    group_ends = torch.zeros(num_experts, dtype=torch.int32, device=device) if ends else None
    if num_rows == 0:
        return Alignment(sorted_ids, expert_ids, num_padded, group_ends)
    scan = SCAN if num_rows <= LONG_ROWS else LONG_SCAN
    _align_kernel[(num_experts,)](
        topk_ids.reshape(-1),
        sorted_ids,
        expert_ids,
        num_padded,
        num_padded if group_ends is None else group_ends,
        num_rows,
        E=num_experts,
        NUM_BINS=triton.next_power_of_2(num_experts + 1),
        BLOCK_M=block_m,
        SCAN=scan,
        WRITE_ENDS=ends,
        num_warps=4 if scan <= 1024 else 8,
    )
    return Alignment(sorted_ids, expert_ids, num_padded, group_ends)
