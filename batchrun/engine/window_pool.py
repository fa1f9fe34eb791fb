"""The sliding layers' own slot space: a layer with a window keeps only its window of KV.

A sliding layer's query at position p reads keys at p - W < k <= p. Where a model has sliding
and full layers (Gemma 2 / 3 / 4), the sliding layers' KV lives in a second pool of its own
slots (the window pool), with its own request-to-token table over the same request rows:

    full pool     slot space of `allocator`     every position a request holds
    window pool   slot space of `WindowSlots`   per running request only its last W positions
                                                (plus what a step adds, and at most
                                                FREE_STRIDE - 1 positions not freed yet)

The attention backend picks the pool, the table and the step's slots by the layer's kind
(attention/windowed.py); the kernels run unchanged over either pool.

Before a request's step, its window slots below kv_len - W + 1 (no query of the step reads
them) go back to the window pool, FREE_STRIDE positions at a time; their table entries point at
the pool's dummy slot, because kernels load (masked) keys before the window (the Triton extend
kernel up to a block of them) and every table entry must stay a valid slot.

The rule (`uses_window_pool`): the window pool runs where the model's KV-writing layers have
both kinds and no hybrid state pool is on. With the radix cache on, the tree holds window slots
too (engine/window_tree.py): a slot is reference counted (each request row whose span holds it,
and the tree), goes back to the pool when the last holder drops it, and a match ends only where
the tree still holds the window before it (docs/gemma4.md states the rule). Elsewhere every
layer keeps every position.

Sizing (`size_window_pool`): per running request its window and a stride, plus one step's
prefill tokens, but at most WINDOW_SHARE of a KV budget read from free memory (and at least one
request's); the rest goes to the full layers (`split_kv_budget`), and the scheduler runs at most
the requests whose windows the pool holds (`max_requests`). A 16k-token request then holds 16,384
full-pool tokens and one window: `requests_held` counts the pool's capacity in such requests,
beside keeping every position (docs/gemma4.md).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

import torch

from batchrun.engine.allocator import TokenAllocator
from batchrun.engine.kv_pool import ReqToTokenPool
from batchrun.models.config import ModelConfig

# window slots behind the window are freed this many positions at a time (fewer table writes
# and allocator calls per step, at this many slots per request)
FREE_STRIDE = 32
# the window pool's most of a KV budget from free memory: the full layers keep the rest, which
# bounds how many long requests run at once (the capacity target in 16k-token requests
# asks the full pool for 3x the tokens of a model whose layers are all full: docs/gemma4.md)
WINDOW_SHARE = 1 / 8


def sliding_kv_indices(cfg: ModelConfig) -> tuple[int, ...]:
    """The KV pool indices (positions in cfg.kv_layers) of the layers with a sliding window."""
    return tuple(i for i, layer in enumerate(cfg.kv_layers) if cfg.window(layer) > 0)


def uses_window_pool(cfg: ModelConfig, has_states: bool) -> bool:
    """Whether the sliding layers keep only their window (the module docstring's rule)."""
    sliding = sliding_kv_indices(cfg)
    return not has_states and 0 < len(sliding) < len(cfg.kv_layers)


def max_window(cfg: ModelConfig) -> int:
    return max(cfg.window(layer) for layer in cfg.kv_layers)


def window_slots(max_running: int, window: int, prefill_budget: int) -> int:
    """Window slots that running requests can hold at once: each its window and a stride (the
    step's decode token included), and one step's prefill tokens over all of them."""
    return max_running * (window + FREE_STRIDE) + prefill_budget


def size_window_pool(
    max_running: int, window: int, prefill: int, budget: int | None, window_per_token: int
) -> int:
    """The window pool's slots: `window_slots`, capped at WINDOW_SHARE of `budget` bytes (None:
    no cap, the KV budget is given in tokens), never below one request's window and a step."""
    want = window_slots(max_running, window, prefill)
    if budget is None:
        return want
    cap = int(budget * WINDOW_SHARE) // window_per_token
    return max(window + FREE_STRIDE + prefill, min(want, cap))


def max_requests(num_slots: int, window: int, prefill: int) -> int:
    """Running requests whose windows (and a step's prefill) a pool of num_slots holds."""
    return max(1, (num_slots - prefill) // (window + FREE_STRIDE))


def requests_held(
    budget: int,
    full_per_token: int,
    window_per_token: int,
    window: int,
    max_running: int,
    prefill: int,
    request_len: int = 16384,
) -> float:
    """Requests of request_len tokens that a KV budget of `budget` bytes holds at once with
    the window pool (window_per_token 0: every layer in the full pool keeps every position)."""
    if not window_per_token:
        return budget // full_per_token / request_len
    num_window = size_window_pool(max_running, window, prefill, budget, window_per_token)
    full = split_kv_budget(budget, full_per_token, window_per_token, num_window, 1)
    return min(full / request_len, max_requests(num_window, window, prefill))


def split_shapes(
    shapes: tuple[tuple[int, int], ...], sliding: tuple[int, ...]
) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """(full pool shapes, window pool shapes): each pool holds its kind's layers at their
    (KV heads, head dim) and the other kind's at zero heads (no bytes), so that both index
    layers as the model does."""
    full = tuple((0, d) if i in sliding else (h, d) for i, (h, d) in enumerate(shapes))
    win = tuple((h, d) if i in sliding else (0, d) for i, (h, d) in enumerate(shapes))
    return full, win


def split_kv_budget(
    budget: int, full_per_token: int, window_per_token: int, num_window_slots: int, page: int
) -> int:
    """The full pool's slots out of `budget` bytes once the window pool has its share."""
    left = budget - num_window_slots * window_per_token
    if left < full_per_token * page:
        raise ValueError(
            f"the KV budget ({budget} bytes) does not hold the sliding layers' windows "
            f"({num_window_slots} tokens of {window_per_token} bytes); lower max_running or "
            "chunked_prefill_size"
        )
    return left // full_per_token // page * page


class WindowSlots:
    """The window pool's slot bookkeeping (host) and its request-to-token table (device).

    Per request row: positions [start, end) hold window slots (the row's span); positions below
    start point at the dummy slot. A slot counts its holders in `refs` (each span that holds it,
    and the radix tree's node that holds it) and goes back to the allocator at zero. `reserve`
    and `reserve_decodes` are idempotent for positions already held, so a caller may retry after
    another allocation failed; where the allocator is short they first ask `evict` (the tree's
    window eviction, engine/window_tree.py) for the rest."""

    def __init__(
        self, num_slots: int, window: int, max_reqs: int, max_context: int, device, prefill: int
    ) -> None:
        self.window = window
        # the running requests whose windows and a step's prefill the pool holds
        self.max_requests = max_requests(num_slots, window, prefill)
        self.allocator = TokenAllocator(num_slots)
        self.dummy_slot = num_slots  # the window KVPool's extra last slot
        self.refs = torch.zeros(num_slots, dtype=torch.int32)
        self.evict: Callable[[int], int] | None = None  # frees at least n slots if it can
        self.req_pool = ReqToTokenPool(max_reqs, max_context, device)
        self.req_pool.table.fill_(self.dummy_slot)
        self.table_cpu = torch.full((max_reqs + 1, max_context), num_slots, dtype=torch.int64)
        self.start = [0] * (max_reqs + 1)
        self.end = [0] * (max_reqs + 1)

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def num_held(self) -> int:
        """Positions the rows' spans hold (a slot the tree holds as well counts here too)."""
        return sum(e - s for s, e in zip(self.start, self.end))

    # -- reference counts -------------------------------------------------------------------

    def hold(self, slots: torch.Tensor) -> None:
        """One more holder of each of `slots` (distinct, held already)."""
        self.refs[slots] += 1

    def drop(self, slots: torch.Tensor) -> int:
        """One holder fewer of each of `slots` (distinct); the ones left with none go back to the
        allocator. Returns how many did."""
        if not slots.numel():
            return 0
        refs = self.refs
        refs[slots] -= 1
        dead = slots[refs[slots] == 0]
        if dead.numel():
            self.allocator.free(dead)
        return dead.numel()

    def allocate(self, n: int) -> torch.Tensor | None:
        """n slots held once (`drop` gives them back), evicting the tree's window slots first
        where the allocator is short; None if it still is."""
        free = self.allocator.num_free
        if free < n and self.evict is not None:
            self.evict(n - free)
        slots = self.allocator.allocate(n)
        if slots is not None:
            self.refs[slots] = 1
        return slots

    # -- a row's span -----------------------------------------------------------------------

    def share(self, row: int, start: int, slots: torch.Tensor) -> None:
        """An admitted row's cached window: positions [start, start + len(slots)) read the
        tree's `slots` (held by the row too from here on)."""
        end = start + slots.numel()
        self.table_cpu[row, start:end] = slots
        self.req_pool.write(row, start, slots)
        self.hold(slots)
        self.start[row], self.end[row] = start, end

    def _trim(self, row: int, kv_len: int) -> None:
        """Drop positions below kv_len - W + 1, once FREE_STRIDE of them have gathered."""
        start = self.start[row]
        upto = min(kv_len - self.window + 1, self.end[row])
        if upto - start < FREE_STRIDE:
            return
        self.drop(self.table_cpu[row, start:upto].clone())
        dummy = torch.full((upto - start,), self.dummy_slot, dtype=torch.int64)
        self.table_cpu[row, start:upto] = dummy
        self.req_pool.write(row, start, dummy)
        self.start[row] = upto

    def reserve(self, row: int, kv_len: int, num_tokens: int) -> bool:
        """Window slots for positions [kv_len, kv_len + num_tokens); False if the pool is short
        (what this row held behind its window is dropped either way)."""
        self._trim(row, kv_len)
        end = self.end[row]
        need = kv_len + num_tokens - end
        if need <= 0:
            return True
        slots = self.allocate(need)
        if slots is None:
            return False
        self.table_cpu[row, end : end + need] = slots
        self.req_pool.write(row, end, slots)
        self.end[row] = end + need
        return True

    def reserve_decodes(self, rows: list[int], kv_lens: list[int]) -> bool:
        """One window slot each at position kv_len, in one allocation; False if short."""
        needers: list[int] = []
        cols: list[int] = []
        for row, kv_len in zip(rows, kv_lens):
            self._trim(row, kv_len)
            if kv_len >= self.end[row]:
                needers.append(row)
                cols.append(kv_len)
        if not needers:
            return True
        slots = self.allocate(len(needers))
        if slots is None:
            return False
        self.table_cpu[_int64(needers), _int64(cols)] = slots
        self.req_pool.write_many(needers, cols, slots)
        for row, col in zip(needers, cols):
            self.end[row] = col + 1
        return True

    def release(self, row: int) -> None:
        """The request left its row: it drops its span (the slots no tree node holds go back)."""
        start, end = self.start[row], self.end[row]
        if end > start:
            self.drop(self.table_cpu[row, start:end].clone())
        self.start[row] = self.end[row] = 0

    def span(self, row: int, upto: int) -> torch.Tensor:
        """The row's window slots of positions [0, upto), the dummy slot outside its span (what
        the tree takes when the row's KV goes to it)."""
        out = torch.full((upto,), self.dummy_slot, dtype=torch.int64)
        start, end = self.start[row], min(self.end[row], upto)
        if end > start:
            out[start:end] = self.table_cpu[row, start:end]
        return out

    def span_slots(self) -> torch.Tensor:
        """The slots of every row's span, a holder each (for the integrity check)."""
        parts = [self.table_cpu[r, s:e] for r, (s, e) in enumerate(zip(self.start, self.end))]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def locs(self, rows: list[int], starts: list[int], lens: list[int]) -> torch.Tensor:
        """The window slots of a step's new tokens, request by request (a new CPU tensor)."""
        table = self.table_cpu
        num_decodes = 0  # the leading one-token requests: one indexing for all of them
        while num_decodes < len(lens) and lens[num_decodes] == 1:
            num_decodes += 1
        parts = []
        if num_decodes:
            picked = (_int64(rows[:num_decodes]), _int64(starts[:num_decodes]))
            parts.append(table[picked])
        for r, s, n in zip(rows[num_decodes:], starts[num_decodes:], lens[num_decodes:]):
            parts.append(table[r, s : s + n])
        if len(parts) == 1:
            return parts[0].clone()
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def check_integrity(self, tree_slots: torch.Tensor | None = None) -> None:
        """Every slot's count equals its holders (the spans, and `tree_slots`: the slots the
        tree's nodes hold), and free + held == capacity."""
        self.allocator.check_no_double_free()
        holders = self.span_slots()
        if tree_slots is not None:
            holders = torch.cat([holders, tree_slots])
        assert bool((holders < self.dummy_slot).all()), "window span holds the dummy slot"
        counts = torch.bincount(holders, minlength=self.capacity).to(torch.int32)
        assert torch.equal(counts, self.refs), "window slot counts differ from their holders"
        held = int((counts > 0).sum())
        assert self.allocator.num_free + held == self.capacity, (
            f"window pool: {self.allocator.num_free} free + {held} held != {self.capacity}"
        )


def _int64(values: list[int]) -> torch.Tensor:
    """A CPU int64 tensor of `values` (non-empty), built in C rather than element by element."""
    return torch.frombuffer(array("q", values), dtype=torch.int64)
