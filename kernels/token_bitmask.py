"""Apply a grammar's token bitmask to the logits in place, in one launch: for each masked row,
every token whose bit is 0, and every id past the tokenizer's vocabulary, gets -inf.

    r = indices[g];  logits[r, j] = -inf  where j >= mask_vocab or not bit j of bitmask[r]

Replaces xgrammar's Triton kernel (whose Python wrapper queries the device properties on every
call) plus the index_fill of the ids past the tokenizer: one kernel, one small launch, on the
grammar step's critical path (the sampling waits for it). Grid (G, cdiv(V, BLOCK)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _apply_token_bitmask_kernel(
    Logits,
    Bitmask,
    Indices,
    stride_logits,
    stride_bitmask,
    vocab_size,
    mask_vocab,
    BLOCK: tl.constexpr,
):
    row = tl.load(Indices + tl.program_id(0)).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < vocab_size
    in_mask = offs < mask_vocab
    words = tl.load(Bitmask + row * stride_bitmask + offs // 32, mask=in_mask, other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    tl.store(
        Logits + row * stride_logits + offs,
        tl.full([BLOCK], float("-inf"), tl.float32).to(Logits.dtype.element_ty),
        mask=in_vocab & ~(allowed & in_mask),
    )


def apply_token_bitmask_(
    logits: torch.Tensor,  # [S, V], unit stride along V
    bitmask: torch.Tensor,  # [>= max(indices) + 1, ceil(mask_vocab / 32)] int32
    indices: torch.Tensor,  # [G] int32 / int64: the rows the mask applies to
    mask_vocab: int,  # ids >= this are never allowed (the tokenizer's vocabulary ends there)
) -> None:
    num_rows = indices.numel()
    vocab_size = logits.shape[-1]
    assert logits.stride(-1) == 1 and bitmask.dtype == torch.int32 and bitmask.stride(-1) == 1
    assert bitmask.shape[-1] * 32 >= min(mask_vocab, vocab_size)
    if num_rows == 0:
        return
    grid = (num_rows, triton.cdiv(vocab_size, BLOCK))
    _apply_token_bitmask_kernel[grid](
        logits, bitmask, indices, logits.stride(0), bitmask.stride(0), vocab_size, mask_vocab,
        BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
