"""Free list of KV slots for the token-indexed KV pool.

Slots ``0 .. num_slots-1`` are grouped into pages of ``page_size`` consecutive slots; page ``p``
owns slots ``p*P .. p*P+P-1``. Everything is tracked per page, so page size 1 is simply "one slot
per page". The allocator never touches the GPU: slot ids are int64 CPU tensors that the scheduler
writes into the request-to-token table.

Layout of the free list::

    _free_pages   [ p7 p8 p9 ... ]          taken from the front on allocate
    _freed_chunks [ [p3 p4], [p1], ... ]     appended on free, concatenated only when needed

Freeing is an O(1) append of a tensor view (no Python loop per slot), allocating is a slice.
"""

from __future__ import annotations

import torch

__all__ = ["TokenAllocator"]


class TokenAllocator:
    """Page-granular allocator of KV slots.

    With ``debug=True`` every allocate/free also maintains a per-page "is free" bitmap, so a double
    free or a free of a never-allocated page raises ``AssertionError`` at the offending call.
    Without it, ``check_no_double_free()`` finds the same corruption after the fact (tests call it).
    """

    def __init__(self, num_slots: int, page_size: int = 1, debug: bool = False) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots < 0 or num_slots % page_size:
            raise ValueError(f"num_slots={num_slots} is not a multiple of page_size={page_size}")
        self.capacity = num_slots
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.debug = debug
        # NOTE: built once; page -> slot expansion is `pages[:, None] * P + _page_offsets`.
        self._page_offsets = torch.arange(page_size, dtype=torch.int64)
        self.reset()

    def reset(self) -> None:
        """Mark every slot free (forgets all outstanding allocations)."""
        self._free_pages = torch.arange(self.num_pages, dtype=torch.int64)  # [num_free_pages]
        self._freed_chunks: list[torch.Tensor] = []
        self._num_free_pages = self.num_pages
        self._is_free = torch.ones(self.num_pages, dtype=torch.bool) if self.debug else None

    @property
    def num_free(self) -> int:
        """Free slots (always a multiple of ``page_size``)."""
        return self._num_free_pages * self.page_size

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    def allocate(self, num_tokens: int) -> torch.Tensor | None:
        """Return ``num_tokens`` slot ids made of whole pages, or None (allocating nothing).

        ``num_tokens`` must be a multiple of ``page_size``; the caller rounds up.
        """
        if num_tokens < 0 or num_tokens % self.page_size:
            raise ValueError(
                f"num_tokens={num_tokens} is not a non-negative multiple of "
                f"page_size={self.page_size}"
            )
        num_pages = num_tokens // self.page_size
        if num_pages > self._num_free_pages:
            return None
        if num_pages > self._free_pages.numel():
            self._merge_freed()
        pages = self._free_pages[:num_pages]
        self._free_pages = self._free_pages[num_pages:]
        self._num_free_pages -= num_pages
        if self._is_free is not None:
            assert bool(self._is_free[pages].all()), "allocator corrupted: handing out a used page"
            self._is_free[pages] = False
        return self._pages_to_slots(pages)

    def free(self, slots: torch.Tensor) -> None:
        """Return whole pages to the free list. ``slots`` lists full pages, page-aligned."""
        n = slots.numel()
        if n == 0:
            return
        P = self.page_size
        if n % P:
            raise ValueError(f"freeing {n} slots, not a multiple of page_size={P}")
        # NOTE: always a copy, so later writes to the caller's buffer (e.g. a req-to-token table
        # row that `slots` is a view of) cannot change what we consider free.
        pages = (slots[::P] // P).long() if P > 1 else slots.to(torch.int64, copy=True)
        if self._is_free is not None:
            self._check_free_arg(slots, pages)
            self._is_free[pages] = True
        self._freed_chunks.append(pages)
        self._num_free_pages += pages.numel()
        # Cheap guard that always runs: catches gross double frees (e.g. freeing after reset()).
        if self._num_free_pages > self.num_pages:
            raise AssertionError(
                f"double free: {self._num_free_pages} free pages > {self.num_pages} pages"
            )

    def free_slots(self) -> torch.Tensor:
        """All free slot ids (int64, unordered). For integrity checks, not the hot path."""
        self._merge_freed()
        return self._pages_to_slots(self._free_pages)

    def check_no_double_free(self) -> None:
        """Assert that the free list has no duplicate page and matches the free counter."""
        self._merge_freed()
        pages = self._free_pages
        assert pages.numel() == self._num_free_pages, (
            f"free list holds {pages.numel()} pages but counter says {self._num_free_pages}"
        )
        if pages.numel():
            assert int(pages.min()) >= 0 and int(pages.max()) < self.num_pages, (
                "free list holds an out-of-range page"
            )
            counts = torch.bincount(pages, minlength=self.num_pages)
            dup = torch.nonzero(counts > 1).flatten()
            assert dup.numel() == 0, f"double free of pages {dup[:8].tolist()}"
        if self._is_free is not None:
            assert int(self._is_free.sum()) == self._num_free_pages, "debug bitmap out of sync"

    # -- internals ------------------------------------------------------------------------

    def _merge_freed(self) -> None:
        if self._freed_chunks:
            self._free_pages = torch.cat([self._free_pages, *self._freed_chunks])
            self._freed_chunks = []

    def _pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        if self.page_size == 1:
            return pages.clone()
        return (pages[:, None] * self.page_size + self._page_offsets).flatten()

    def _check_free_arg(self, slots: torch.Tensor, pages: torch.Tensor) -> None:
        """Debug-mode validation: aligned whole pages, in range, currently allocated, no repeats."""
        s = slots.to(torch.int64)
        assert int(s.min()) >= 0 and int(s.max()) < self.capacity, "freeing out-of-range slot"
        if self.page_size > 1:
            expect = self._pages_to_slots(pages)
            assert torch.equal(s, expect), "freed slots are not whole page-aligned pages in order"
        assert torch.unique(pages).numel() == pages.numel(), "same page freed twice in one call"
        already = torch.nonzero(self._is_free[pages]).flatten()
        assert already.numel() == 0, f"double free of pages {pages[already][:8].tolist()}"
