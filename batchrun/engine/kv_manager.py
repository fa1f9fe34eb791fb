"""KV bookkeeping for requests: rows, slots, and hand-over of computed KV to the radix cache.

The scheduler decides *what* runs; this module does the slot arithmetic (see request.py's map)
and keeps the invariant the tests check after every step:

    allocator.num_free + cache.total_size + slots held by requests outside the tree == capacity

Sliding windows (ModelConfig.sliding_windows). The slots of `allocator` hold the KV of every
layer a model keeps in its one pool, so a request keeps each of them until it ends (then they go
to the radix cache as any other): where every layer is windowed (Mistral v0.1: 4096 tokens) the
pool holds every position, which saves memory only on sequences longer than the window, which
batch jobs seldom run. A model of sliding and full layers keeps its sliding layers' KV in a pool
of its own (`window`, engine/window_pool.py): `reserve` and `reserve_decodes` take its slots too
(dropping those behind the window first), `release` drops the row's span; the slots of
`allocator` are the full layers'. With the radix cache on, the tree holds window slots beside the
KV it takes (engine/window_tree.py): a hand-over gives it the row's span up to the aligned
length, an admission starts the row's span with the match's window, and the window pool's
allocations evict the tree's window slots when short.

Hybrid models (cache.snapshots, engine/state_snapshots.py). A match ends at a node with a state
snapshot, which admission copies into the request's state row; a prefill chunk that ends at one
of the request's snapshot boundaries (Req.snapshot_at) saves its state at the node where its KV
ends; a retracted request saves its state at its computed length, to resume from it.
"""

from __future__ import annotations

from array import array

import torch

from batchrun.engine.allocator import TokenAllocator
from batchrun.engine.kv_pool import ReqToTokenPool
from batchrun.engine.radix_cache import MatchResult, RadixCache, TreeNode
from batchrun.engine.request import Req
from batchrun.engine.window_pool import WindowSlots


class KVManager:
    def __init__(
        self,
        allocator: TokenAllocator,
        cache: RadixCache,
        req_pool: ReqToTokenPool,
        window: WindowSlots | None = None,
    ):
        self.allocator = allocator
        self.cache = cache
        self.req_pool = req_pool
        self.page_size = allocator.page_size
        self.snapshots = cache.snapshots  # a hybrid model's state snapshots; None: dense
        # slots of running requests not owned by the tree (for the integrity check)
        self.num_private = 0
        # host copy of the request-to-token table: slot ids are needed on the host to free and
        # insert, and reading them back from the device would sync
        self.table_cpu = torch.zeros(req_pool.table.shape, dtype=torch.int64)
        # the sliding layers' own slots (engine/window_pool.py); None: every layer keeps every
        # position in the slots above
        self.window = window
        if window is not None and cache.windows is not None:
            window.evict = cache.windows.evict

    @property
    def cache_enabled(self) -> bool:
        return not self.cache.disable

    @property
    def available(self) -> int:
        """Slots obtainable now: free plus evictable."""
        return self.allocator.num_free + self.cache.evictable_size

    def page_ceil(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    # -- admission ---------------------------------------------------------------------------

    def match(self, req: Req) -> MatchResult:
        """The cached prefix `req` would get if admitted now."""
        return self.cache.match_prefix(req.cache_key)

    def admit(self, req: Req, match: MatchResult | None = None) -> bool:
        """Give `req` a row and its cached prefix (`match`, if the caller just looked it up with
        `self.match(req)` and changed nothing since). False when no row is free."""
        row = self.req_pool.allocate()
        if row is None:
            return False
        req.row = row
        if match is None:
            match = self.match(req)
        self.cache.lock(match.last_node)
        length = match.length
        if length:
            self._write(req, 0, match.slots)
            if self.snapshots is not None:
                self.snapshots.load(match.last_node, row)
            if self.window is not None:
                self.window.share(row, match.window_start, match.window)
        req.last_node, req.prefix_len, req.kv_len, req.alloc_len = (
            match.last_node,
            length,
            length,
            length,
        )
        if req.cached_tokens is None:
            req.cached_tokens = min(length, len(req.input_ids))
        return True

    def match_len(self, ids: list[int]) -> int:
        """How much of `ids` is cached, without touching locks (for planning)."""
        return self.cache.match_prefix(ids).length if self.cache_enabled else 0

    # -- slots for a step --------------------------------------------------------------------

    def reserve(self, req: Req, num_tokens: int) -> torch.Tensor | None:
        """Slots for positions [kv_len, kv_len + num_tokens), allocating (and evicting) as needed.
        Returns them as a CPU int64 tensor, or None if the pool cannot provide them."""
        if self.window is not None and not self.window.reserve(req.row, req.kv_len, num_tokens):
            return None
        need = self.page_ceil(req.kv_len + num_tokens) - req.alloc_len
        if need > 0:
            slots = self.allocate(need)
            if slots is None:
                return None
            self._write(req, req.alloc_len, slots)
            req.alloc_len += need
            self.num_private += need
        return self.table_cpu[req.row, req.kv_len : req.kv_len + num_tokens]

    def reserve_decodes(self, reqs: list[Req]) -> bool:
        """One slot each for a decode step, in one allocation (the per-step hot path).
        All or nothing: False leaves every request as it was."""
        page = self.page_size
        if self.window is not None and not self.window.reserve_decodes(
            [r.row for r in reqs], [r.kv_len for r in reqs]
        ):
            return False
        needers = [r for r in reqs if r.kv_len >= r.alloc_len]  # kv_len + 1 > alloc_len
        if not needers:
            return True
        slots = self.allocate(len(needers) * page)
        if slots is None:
            return False
        if page == 1:
            rows = [r.row for r in needers]
            cols = [r.alloc_len for r in needers]
        else:  # needer i gets slots[i * page : (i + 1) * page]
            rows = [r.row for r in needers for _ in range(page)]
            cols = [c for r in needers for c in range(r.alloc_len, r.alloc_len + page)]
        self.table_cpu[_int64(rows), _int64(cols)] = slots
        self.req_pool.write_many(rows, cols, slots)
        for r in needers:
            r.alloc_len += page
        self.num_private += len(needers) * page
        return True

    def slots_at(self, rows: list[int], cols: list[int]) -> torch.Tensor:
        """table_cpu[rows, cols] as a new int64 tensor (non-empty lists)."""
        # NOTE: indexing with tensors: with Python lists torch converts element by element
        return self.table_cpu[_int64(rows), _int64(cols)]

    def allocate(self, num_tokens: int) -> torch.Tensor | None:
        if self.allocator.num_free < num_tokens:
            self.cache.evict(num_tokens - self.allocator.num_free)
        return self.allocator.allocate(num_tokens)

    # -- hand-over to the tree -----------------------------------------------------------------

    def cache_unfinished(self, req: Req) -> None:
        """Put the computed KV of a still-running request into the tree, so that requests sharing
        its prefix hit the cache now rather than when it finishes."""
        if not self.cache_enabled:
            return
        aligned = req.kv_len // self.page_size * self.page_size
        if aligned <= req.prefix_len:
            return
        key = req.tokens(0, aligned)
        num_existing, node = self._insert(req, key, aligned)
        # point our row at the tree's slots: only [prefix_len, num_existing) can differ (ours
        # are duplicates, which _insert freed); below prefix_len the row holds the tree's slots
        # already (a locked path keeps its values) and from num_existing on the tree took ours
        # NOTE: no re-match: insert stamped the same path with the newest LRU time
        if num_existing > req.prefix_len:
            match = self.cache.match_prefix(key, resumable=False)  # the KV, as inserted
            assert match.length == aligned, "tree lost a prefix that was just inserted"
            self._write(req, req.prefix_len, match.slots[req.prefix_len : num_existing])
        self.cache.lock(node)
        self.cache.unlock(req.last_node)
        req.last_node, req.prefix_len = node, aligned
        at = req.snapshot_at
        if at and at[0] <= aligned:
            # the chunk ends at a boundary (the scheduler cuts chunks there); a boundary passed
            # without a snapshot is dropped
            if at[0] == req.kv_len:
                self.snapshots.save(req.row, node)
            req.snapshot_at = tuple(b for b in at if b > aligned)

    def release(self, req: Req, keep_state: bool = False) -> None:
        """Finished or retracted: keep the computed KV in the tree (if enabled), free the rest.
        keep_state (retraction): a hybrid's state at the computed length is kept as a snapshot
        too, if that length is page-aligned."""
        row = req.row
        if self.cache_enabled:
            aligned = req.kv_len // self.page_size * self.page_size
            node = req.last_node  # where [0, prefix_len) ends
            if aligned > req.prefix_len:
                node = self._insert(req, req.tokens(0, aligned), aligned)[1]
            if keep_state and self.snapshots is not None and 0 < aligned == req.kv_len:
                self.snapshots.save(row, node)
            tail_start = max(aligned, req.prefix_len)
        else:
            tail_start = req.prefix_len  # 0: nothing is owned by a disabled tree
        if req.alloc_len > tail_start:
            self.allocator.free(self.table_cpu[row, tail_start : req.alloc_len].clone())
            self.num_private -= req.alloc_len - tail_start
        self.cache.unlock(req.last_node)
        if self.window is not None:
            self.window.release(row)
        self.req_pool.free(row)
        req.row, req.last_node, req.penalty_row = None, None, None
        req.kv_len = req.alloc_len = req.prefix_len = 0
        req.snapshot_at = ()

    def _insert(self, req: Req, key: list[int], aligned: int) -> tuple[int, TreeNode]:
        """Give [prefix_len, aligned) to the tree; returns how many leading tokens it had and
        the node where `key` ends."""
        # a view: the tree clones what it keeps and the allocator copies what it frees
        slots = self.table_cpu[req.row, :aligned]
        window = self.window.span(req.row, aligned) if self.window is not None else None
        num_existing, node = self.cache.insert_path(key, slots, window)
        # [prefix_len, num_existing): we computed what the tree already had; ours are spare
        if num_existing > req.prefix_len:
            self.allocator.free(slots[req.prefix_len : num_existing])
        # the tree now owns [prefix_len, aligned) (ours or its own copies)
        self.num_private -= aligned - req.prefix_len
        return num_existing, node

    def _write(self, req: Req, start: int, slots: torch.Tensor) -> None:
        self.table_cpu[req.row, start : start + len(slots)] = slots
        self.req_pool.write(req.row, start, slots)

    def check_integrity(self) -> None:
        self.cache.check_integrity(self.num_private)
        if self.window is not None:
            tree = self.cache.window_slots() if self.cache.windows is not None else None
            self.window.check_integrity(tree)


def _int64(values: list[int]) -> torch.Tensor:
    """A CPU int64 tensor of `values` (non-empty), built in C rather than element by element."""
    return torch.frombuffer(array("q", values), dtype=torch.int64)
