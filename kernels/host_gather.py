"""Rows of a table in pinned host memory gathered by the GPU, the ids staying on the GPU:

    out[t, :] = table[ids[t], :] * scale        out [T, D] on the ids' device, table [V, D]

A pinned (page-locked) host tensor is mapped into the GPU's address space (unified virtual
addressing): the kernel reads its rows over PCIe / NVLink-C2C with ordinary loads, so a step
that needs T rows moves T * D elements, the table never on the GPU, no host round trip for the
ids and nothing a CUDA graph cannot capture. Gemma 4's E-models keep their per-layer embedding
table this way where the plan says so (engine/kernel_choice.py's per_layer_table_rule).

Grid (T, cdiv(D, BLOCK_D)): one program a row's BLOCK_D columns. The product with `scale` is
taken in fp32 and rounded once to the table's dtype, as torch's `table[ids] * scale` rounds a
bf16 product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_D = 1024


@triton.jit
def _gather_rows_kernel(Table, Ids, Out, cols, stride_t, stride_o, scale, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    row = tl.load(Ids + t).to(tl.int64)
    v = tl.load(Table + row * stride_t + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + t.to(tl.int64) * stride_o + offs, (v * scale).to(Out.dtype.element_ty),
             mask=mask)  # fmt: skip


def gather_rows(table: torch.Tensor, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """table[ids] * scale as [T, D] in table's dtype on ids' device. table [V, D]: pinned host
    memory (or any memory the ids' device can read), unit stride along D; ids [T] int32 / int64."""
    assert table.dim() == 2 and table.stride(1) == 1, table.shape
    assert ids.dim() == 1, ids.shape
    if ids.is_cuda:
        assert table.is_cuda or table.is_pinned(), "a host table must be pinned to be read"
    out = torch.empty((ids.shape[0], table.shape[1]), dtype=table.dtype, device=ids.device)
    if ids.shape[0] == 0:
        return out
    block = min(BLOCK_D, triton.next_power_of_2(table.shape[1]))
    grid = (ids.shape[0], triton.cdiv(table.shape[1], block))
    _gather_rows_kernel[grid](
        table, ids, out, table.shape[1], table.stride(0), out.stride(0), float(scale), BLOCK=block
    )
    return out
