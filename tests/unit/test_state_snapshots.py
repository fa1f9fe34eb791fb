"""The radix cache of a hybrid model (engine/state_snapshots.py): matches end at a node with a
state snapshot, eviction frees snapshots with their nodes, a full snapshot pool replaces its
least recently used unlocked snapshot, copies move a state row in and out; the boundary rule and
its prediction (job/order.snapshot_reuse_lens) agree."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from batchrun.engine.allocator import TokenAllocator
from batchrun.engine.radix_cache import RadixCache
from batchrun.engine.state_snapshots import (
    MIN_SNAPSHOT_PREFIX,
    StateSnapshots,
    boundaries,
    num_snapshots,
)
from batchrun.job.order import reuse_lens, snapshot_reuse_lens, sort_key


def make_cache(capacity: int = 2, num_slots: int = 256, page_size: int = 1):
    """A snapshot pool over a fake state pool of 3 rows, 2 layers."""
    states = SimpleNamespace(
        conv=torch.zeros(2, 3, 4, 2), ssm=torch.zeros(2, 3, 2, 2, 2), bytes_per_row=lambda: 128
    )
    snaps = StateSnapshots(states, capacity)
    snaps.allocate()
    alloc = TokenAllocator(num_slots, page_size=page_size, debug=True)
    return states, snaps, alloc, RadixCache(alloc, page_size, snapshots=snaps)


def put(alloc, cache, ids):
    slots = alloc.allocate(len(ids))
    num_existing, node = cache.insert_path(ids, slots)
    alloc.free(slots[:num_existing])
    return node


def test_a_match_is_cut_back_to_the_deepest_snapshot() -> None:
    _, snaps, alloc, cache = make_cache()
    a = list(range(1, 41))
    leaf = put(alloc, cache, a)
    assert cache.match_prefix(a).length == 0  # KV without a snapshot is no hit
    mid = put(alloc, cache, a[:20])  # splits the edge: the upper half ends at 20
    assert snaps.save(0, mid)
    m = cache.match_prefix(a + [99])
    assert m.length == 20 and m.last_node is mid
    assert snaps.save(1, leaf)
    assert cache.match_prefix(a + [99]).length == 40
    assert cache.match_prefix(a[:30] + [99]).length == 20  # a split below the snapshot
    cache.check_integrity(0)


def test_eviction_frees_the_snapshots_of_its_nodes() -> None:
    _, snaps, alloc, cache = make_cache()
    snaps.save(0, put(alloc, cache, list(range(1, 30))))
    snaps.save(1, put(alloc, cache, list(range(100, 130))))
    assert snaps.num_free == 0
    cache.evict(cache.evictable_size)
    assert snaps.num_free == 2 and cache.total_size == 0
    cache.check_integrity(0)
    snaps.save(0, put(alloc, cache, list(range(1, 30))))
    cache.reset()
    assert snaps.num_free == 2
    cache.check_integrity(0)


def test_a_full_pool_replaces_its_least_recently_used_unlocked_snapshot() -> None:
    _, snaps, alloc, cache = make_cache()
    a, b, c = (list(range(s, s + 20)) for s in (1, 100, 200))
    na, nb = put(alloc, cache, a), put(alloc, cache, b)
    snaps.save(0, na)
    snaps.save(0, nb)
    cache.match_prefix(a + [7])  # a is the more recent
    nc = put(alloc, cache, c)
    assert snaps.save(0, nc)
    assert nb.snapshot is None and na.snapshot is not None and snaps.num_replaced == 1
    assert cache.match_prefix(b + [7]).length == 0
    cache.lock(na)
    cache.lock(nc)
    assert not snaps.save(0, put(alloc, cache, list(range(300, 320))))  # every owner locked
    cache.unlock(na)
    cache.unlock(nc)
    cache.check_integrity(0)


def test_save_and_load_copy_a_state_row() -> None:
    states, snaps, alloc, cache = make_cache()
    states.conv[:, 1] = 3.0
    states.ssm[:, 1] = 4.0
    node = put(alloc, cache, list(range(1, 20)))
    snaps.save(1, node)
    states.conv[:, 1] = 0.0
    snaps.load(node, 2)
    assert bool((states.conv[:, 2] == 3.0).all()) and bool((states.ssm[:, 2] == 4.0).all())
    assert bool((states.conv[:, 0] == 0.0).all())


def test_boundaries_are_the_common_prefixes_with_the_followers() -> None:
    base = list(range(1, 101))
    followers = [base[:50] + [999], base[:30] + [7, 8], base + [5], [1, 2, 3], base[:10] + [0]]
    assert boundaries(base, 0, followers) == (30, 50, 100)
    assert boundaries(base, 40, followers) == (100,)  # 50: fewer than 16 past 40
    assert boundaries(base, 30, followers) == (50, 100)
    assert boundaries(base, 0, [base]) == (99,)  # a follower may match its length - 1
    assert boundaries(base, 0, followers, page=8) == (24, 48, 96)
    assert boundaries(base, 0, [base[: MIN_SNAPSHOT_PREFIX - 1] + [0]]) == ()
    assert num_snapshots(7) == 4 and num_snapshots(1023) == 128


def test_snapshot_reuse_counts_only_the_boundaries() -> None:
    head = list(range(1, 65))
    group = [head + [200 + i, 300 + i] for i in range(5)]  # a shared 64-token prefix
    nested = [head + list(range(100, 140)) + [500 + i] for i in range(3)]  # 104 shared
    short = [[9, 9, 9, 9]]  # shares nothing
    keys = sorted(sort_key(p) for p in group + nested + short)
    dense = reuse_lens(keys)
    hybrid = snapshot_reuse_lens(keys, lookahead=8, min_len=MIN_SNAPSHOT_PREFIX)
    assert hybrid.tolist() == dense.tolist()  # every boundary seen ahead
    # a look-ahead of 1: the nested group comes first in DFS order, and its first prompt sees
    # only its neighbour (104 shared), so no snapshot at 64 exists for the group's first prompt
    narrow = snapshot_reuse_lens(keys, lookahead=1, min_len=MIN_SNAPSHOT_PREFIX)
    assert (dense - narrow).tolist() == [0, 0, 0, 64, 0, 0, 0, 0, 0]
