from __future__ import annotations

import heapq
from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from batchrun.engine.allocator import TokenAllocator
from batchrun.engine.radix_cache import MatchResult, RadixCache


def make_cache(
    num_slots: int = 64, page_size: int = 1, disable: bool = False
) -> tuple[TokenAllocator, RadixCache]:
    alloc = TokenAllocator(num_slots, page_size=page_size, debug=True)
    return alloc, RadixCache(alloc, page_size=page_size, disable=disable)


def put(alloc: TokenAllocator, cache: RadixCache, ids: list[int]) -> torch.Tensor:
    """Allocate slots for ``ids``, insert them, free the duplicates; return the slots."""
    slots = alloc.allocate(len(ids))
    assert slots is not None
    n_dup = cache.insert(ids, slots)
    alloc.free(slots[:n_dup])
    return slots


def test_match_empty() -> None:
    alloc, cache = make_cache()
    m = cache.match_prefix([1, 2, 3])
    assert isinstance(m, MatchResult)
    assert m.length == 0 and m.slots.dtype == torch.int64 and m.last_node is cache.root
    assert cache.match_prefix([]).length == 0
    cache.check_integrity(0)


def test_insert_and_match() -> None:
    alloc, cache = make_cache()
    slots = put(alloc, cache, [1, 2, 3])
    m = cache.match_prefix([1, 2, 3, 4])
    assert m.length == 3 and m.slots.tolist() == slots.tolist()
    assert m.last_node.key == (1, 2, 3)
    assert cache.match_prefix((1, 2)).slots.tolist() == slots[:2].tolist()
    assert cache.total_size == cache.evictable_size == 3
    cache.check_integrity(0)


def test_split_node_mid_edge() -> None:
    alloc, cache = make_cache()
    slots = put(alloc, cache, [1, 2, 3, 4])
    cache.lock(cache.match_prefix([1, 2, 3, 4]).last_node)
    m = cache.match_prefix([1, 2, 9])
    assert m.length == 2 and m.slots.tolist() == slots[:2].tolist()
    upper = cache.root.children[1]
    assert upper is m.last_node and upper.key == (1, 2)
    lower = upper.children[3]
    assert lower.key == (3, 4) and lower.value.tolist() == slots[2:].tolist()
    # Both halves keep the lock count and the access time of the original node.
    assert upper.ref == lower.ref == 1 and upper.last_access >= lower.last_access
    assert cache.protected_size == 4
    cache.check_integrity(0)


def test_duplicate_insert_returns_overlap() -> None:
    alloc, cache = make_cache()
    first = put(alloc, cache, [1, 2, 3])
    second = alloc.allocate(5)
    assert second is not None
    assert cache.insert([1, 2, 3, 4, 5], second) == 3
    alloc.free(second[:3])
    assert cache.insert([1, 2, 3], first) == 3  # fully present: tree takes nothing
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert m.slots.tolist() == first.tolist() + second[3:].tolist()
    # Diverging in the middle of an edge splits it and adds a sibling.
    third = alloc.allocate(4)
    assert third is not None
    assert cache.insert([1, 2, 7, 7], third) == 2
    alloc.free(third[:2])
    assert cache.total_size == 7
    cache.check_integrity(0)


def test_lock_protects_from_eviction() -> None:
    alloc, cache = make_cache()
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [1, 2, 4, 5])
    m = cache.match_prefix([1, 2, 4, 5])
    cache.lock(m.last_node)
    assert cache.protected_size == 4 and cache.evictable_size == 1
    assert cache.evict(100) == 1  # only the unlocked [3] leaf
    assert cache.match_prefix([1, 2, 4, 5]).length == 4
    cache.unlock(m.last_node)
    assert cache.evictable_size == 4 and cache.protected_size == 0
    with pytest.raises(AssertionError):
        cache.unlock(m.last_node)
    cache.check_integrity(0)
    assert cache.evict(100) == 4
    assert cache.total_size == 0 and alloc.num_free == alloc.capacity
    cache.check_integrity(0)


def test_lru_order_of_eviction() -> None:
    alloc, cache = make_cache()
    put(alloc, cache, [1, 1])
    put(alloc, cache, [2, 2])
    put(alloc, cache, [3, 3])
    cache.match_prefix([1, 1])  # refresh: [2, 2] is now the oldest
    assert cache.evict(1) == 2
    assert cache.match_prefix([2, 2]).length == 0
    assert cache.match_prefix([1, 1]).length == 2
    assert cache.evict(1) == 2  # [3, 3] is older than the refreshed [1, 1]
    assert cache.match_prefix([3, 3]).length == 0
    cache.check_integrity(0)


def test_eviction_makes_parent_a_leaf() -> None:
    alloc, cache = make_cache()
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [1, 2, 4])
    assert cache.root.children[1].key == (1, 2)
    put(alloc, cache, [9])  # newest
    assert cache.evict(2) == 2  # both one-token children go first
    assert cache.match_prefix([1, 2, 3]).length == 2
    assert cache.root.children[1].is_leaf
    # [1, 2] is now a leaf, and older than [9] until something touches it.
    put(alloc, cache, [9])  # refresh [9] through a duplicate insert
    assert cache.evict(1) == 2
    assert cache.match_prefix([1, 2]).length == 0 and cache.match_prefix([9]).length == 1
    assert cache.evict(3) == 1
    assert cache.total_size == 0
    cache.check_integrity(0)


def test_page_size_4_truncation() -> None:
    alloc, cache = make_cache(page_size=4)
    ids = list(range(10, 22))  # 12 tokens
    slots = put(alloc, cache, ids)
    assert cache.match_prefix(ids[:7]).length == 4  # truncated to a whole page
    m = cache.match_prefix(ids[:6] + [0, 0, 0, 0])  # mismatch inside page 1 -> page 0 only
    assert m.length == 4 and m.slots.tolist() == slots[:4].tolist()
    assert cache.root.children[tuple(ids[:4])].key == tuple(ids[:4])  # split on a page boundary
    with pytest.raises(ValueError):
        cache.insert(ids[:6], slots[:6])
    other = alloc.allocate(8)
    assert other is not None
    assert cache.insert(ids[:4] + [1, 2, 3, 4], other) == 4
    alloc.free(other[:4])
    assert cache.match_prefix(ids[:4] + [1, 2, 3, 4, 5]).length == 8
    cache.check_integrity(0)


def test_disable() -> None:
    alloc, cache = make_cache(disable=True)
    slots = alloc.allocate(3)
    assert slots is not None
    assert cache.insert([1, 2, 3], slots) == 3  # caller frees everything
    alloc.free(slots)
    assert cache.match_prefix([1, 2, 3]).length == 0
    assert cache.total_size == 0 and cache.evict(10) == 0
    cache.check_integrity(0)


def test_reset_returns_slots_and_pretty() -> None:
    alloc, cache = make_cache(page_size=2)
    put(alloc, cache, [1, 2, 3, 4])
    put(alloc, cache, [1, 2, 5, 6])
    assert "len=2" in cache.pretty()
    cache.reset()
    assert cache.total_size == 0 and alloc.num_free == alloc.capacity
    cache.check_integrity(0)


def test_long_keys_use_fast_mismatch() -> None:
    alloc, cache = make_cache(num_slots=1024)
    ids = list(range(500))
    put(alloc, cache, ids)
    m = cache.match_prefix(ids[:300] + [-1] * 10)
    assert m.length == 300
    cache.check_integrity(0)


# -- randomized interleavings --------------------------------------------------------------


# Token ids built from a few shared 4-token blocks plus a random tail, so that prefixes collide
# page by page (page size 4) as well as token by token.
_BLOCKS = [(0, 0, 0, 0), (1, 1, 1, 1), (0, 1, 0, 1)]
token_ids = st.tuples(
    st.lists(st.sampled_from(_BLOCKS), max_size=3), st.lists(st.integers(0, 1), max_size=6)
).map(lambda t: [x for block in t[0] for x in block] + t[1])


def reference_evict_slots(cache: RadixCache, num_tokens: int) -> list[int]:
    """The slots `cache.evict(num_tokens)` must free, in order, computed the plain way (without
    touching the tree): a heap of every unlocked leaf by (last_access, id), popped in order, a
    parent joining once its last child is gone and it is unlocked."""
    if num_tokens <= 0:
        return []
    nodes, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    heap = [(n.last_access, n.id, n) for n in nodes if n.parent and not n.children and n.ref == 0]
    heapq.heapify(heap)
    children_left = {id(n): len(n.children) for n in nodes}
    freed, out = 0, []
    while freed < num_tokens and heap:
        _, _, node = heapq.heappop(heap)
        out.extend(node.value.tolist())
        freed += len(node.key)
        parent = node.parent
        children_left[id(parent)] -= 1
        if parent.parent is not None and children_left[id(parent)] == 0 and parent.ref == 0:
            heapq.heappush(heap, (parent.last_access, parent.id, parent))
    return out


@dataclass
class SimRequest:
    ids: list[int]
    match: MatchResult
    slots: torch.Tensor  # [match.length + new pages] prefix from the tree, then our own slots


class CacheMachine(RuleBasedStateMachine):
    """Requests admitted, finished and evicted in random order, SGLang-style."""

    page_size = 1
    num_slots = 48

    def __init__(self) -> None:
        super().__init__()
        self.alloc = TokenAllocator(self.num_slots, page_size=self.page_size, debug=True)
        self.cache = RadixCache(self.alloc, page_size=self.page_size)
        self.running: list[SimRequest] = []
        # Simulated KV contents: slot -> the token prefix whose last token it stores.
        self.kv: dict[int, tuple[int, ...]] = {}

    @property
    def num_in_use(self) -> int:
        return sum(r.slots.numel() - r.match.length for r in self.running)

    def _check_match(self, ids: list[int], m: MatchResult) -> None:
        P = self.page_size
        assert m.length % P == 0 and m.length <= len(ids)
        for i, s in enumerate(m.slots.tolist()):
            assert self.kv[s] == tuple(ids[: i + 1]), "cached slot holds the wrong prefix"

    @rule(ids=token_ids)
    def admit(self, ids: list[int]) -> None:
        m = self.cache.match_prefix(ids)
        self._check_match(ids, m)
        self.cache.lock(m.last_node)
        P = self.page_size
        need = -(-(len(ids) - m.length) // P) * P
        if need > self.alloc.num_free:
            self.cache.evict(need - self.alloc.num_free)
        new = self.alloc.allocate(need)
        if new is None:
            self.cache.unlock(m.last_node)
            return
        slots = torch.cat([m.slots, new])
        for i in range(m.length, len(ids)):  # "compute" the KV of the uncached part
            self.kv[int(slots[i])] = tuple(ids[: i + 1])
        self.running.append(SimRequest(ids, m, slots))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        aligned = len(req.ids) // self.page_size * self.page_size
        n_dup = self.cache.insert(req.ids[:aligned], req.slots[:aligned])
        assert n_dup >= req.match.length
        self.alloc.free(req.slots[req.match.length : n_dup])
        self.alloc.free(req.slots[aligned:])
        self.cache.unlock(req.match.last_node)

    @rule(ids=token_ids)
    def probe(self, ids: list[int]) -> None:
        self._check_match(ids, self.cache.match_prefix(ids))

    @rule(n=st.integers(0, 24))
    def evict(self, n: int) -> None:
        before = self.cache.evictable_size
        expected = reference_evict_slots(self.cache, n)
        freed_slots: list[torch.Tensor] = []
        free = self.alloc.free
        self.alloc.free = lambda slots: (freed_slots.append(slots.clone()), free(slots))[1]
        try:
            freed = self.cache.evict(n)
        finally:
            del self.alloc.free  # back to the class's method
        assert freed >= min(n, before)
        assert self.cache.evictable_size == before - freed
        got = torch.cat(freed_slots).tolist() if freed_slots else []
        assert got == expected, "eviction order differs from a fresh LRU heap of the leaves"

    @invariant()
    def integrity(self) -> None:
        self.cache.check_integrity(self.num_in_use)

    def teardown(self) -> None:
        while self.running:
            self.finish_one()
        self.cache.check_integrity(0)
        assert self.cache.protected_size == 0
        self.cache.evict(self.num_slots)
        assert self.alloc.num_free == self.num_slots

    def finish_one(self) -> None:
        req = self.running.pop()
        aligned = len(req.ids) // self.page_size * self.page_size
        n_dup = self.cache.insert(req.ids[:aligned], req.slots[:aligned])
        self.alloc.free(req.slots[req.match.length : n_dup])
        self.alloc.free(req.slots[aligned:])
        self.cache.unlock(req.match.last_node)


class CacheMachinePage4(CacheMachine):
    page_size = 4


_settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = _settings
TestCacheMachinePage4 = CacheMachinePage4.TestCase
TestCacheMachinePage4.settings = _settings
