"""Per-request token statistics on the device, and the penalties that read them.

Rows are req-pool indices: a request keeps its row while it is running. Nothing here syncs with
the host: `update` scatters the sampled ids that are still on the device, and `apply_penalties`
gathers the batch's rows and edits the logits with element-wise ops.
"""

from __future__ import annotations

import torch


def to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host list -> device tensor; pinned + non-blocking when the device is CUDA."""
    is_cuda = device.type == "cuda"
    return torch.tensor(data, dtype=dtype, pin_memory=is_cuda).to(device, non_blocking=is_cuda)


class PenaltyState:
    """Per-request token statistics on the device for repetition/frequency/presence penalties.

    Memory is allocated on the first `reset_row` (int32 counts + bool seen, [max_rows, V]), so an
    engine that never sees a penalized request pays nothing. Until then `update` is a no-op.

    Contract: call `reset_row` when a request with `params.has_penalties` is admitted or
    re-admitted (it may be called for every request); call `update` with the sampled ids of every
    step (all rows of the batch). Rows that were never reset hold stale stats, which is harmless:
    their penalty parameters are neutral, and `reset_row` clears them before reuse.
    """

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device | str) -> None:
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.counts: torch.Tensor | None = None  # [R, V] int32: occurrences in the output
        self.seen: torch.Tensor | None = None  # [R, V] bool: in the prompt or the output

    @property
    def is_allocated(self) -> bool:
        return self.counts is not None

    def _allocate(self) -> None:
        shape = (self.max_rows, self.vocab_size)
        self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.seen = torch.zeros(shape, dtype=torch.bool, device=self.device)

    def reset_row(self, row: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Start a row over from the request's tokens (at admission or re-admission)."""
        if self.counts is None:
            self._allocate()
        assert self.counts is not None and self.seen is not None
        counts, seen = self.counts[row], self.seen[row]
        counts.zero_()
        seen.zero_()
        if prompt_ids:
            seen.index_fill_(0, to_device(prompt_ids, torch.int64, self.device), True)
        if output_ids:
            out = to_device(output_ids, torch.int64, self.device)
            counts.index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
            seen.index_fill_(0, out, True)

    def update(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count the tokens just sampled. rows, token_ids: [B] int64 on the device."""
        if self.counts is None or self.seen is None:
            return
        flat = rows * self.vocab_size + token_ids  # [B]; rows of one batch are distinct
        self.counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        self.seen.view(-1).index_fill_(0, flat, True)


def apply_penalties(
    logits: torch.Tensor,
    state: PenaltyState,
    rows: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    has_repetition: bool,
    has_frequency_presence: bool,
) -> torch.Tensor:
    """Penalized copy of logits [B, V] fp32. Parameters are [B] fp32; neutral rows are exact."""
    if state.counts is None or state.seen is None:
        raise ValueError("penalties requested but PenaltyState.reset_row was never called")
    if has_repetition:
        # HF semantics over prompt + output tokens: positive logits shrink, negative ones grow.
        p = repetition[:, None]
        penalized = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(state.seen[rows], penalized, logits)
    if has_frequency_presence:
        counts = state.counts[rows].float()  # [B, V]
        logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).float()
    return logits
