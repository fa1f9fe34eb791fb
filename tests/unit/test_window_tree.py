"""The radix tree's window slots (engine/window_tree.py) over the window pool
(engine/window_pool.py): a match ends only where the tree holds the window before it, the
window slots are counted by their holders, go LRU first when the pool is short, and a random
mix of requests sharing prefixes reads, at every step, window KV of its own prefix."""

from __future__ import annotations

import random

import pytest
import torch

from batchrun.engine import window_pool
from batchrun.engine.allocator import TokenAllocator
from batchrun.engine.kv_manager import KVManager
from batchrun.engine.kv_pool import ReqToTokenPool
from batchrun.engine.radix_cache import RadixCache
from batchrun.engine.request import Req
from batchrun.engine.window_pool import WindowSlots
from batchrun.engine.window_tree import TreeWindows
from batchrun.params import SamplingParams

W = 8


@pytest.fixture(autouse=True)
def stride_one(monkeypatch):
    monkeypatch.setattr(window_pool, "FREE_STRIDE", 1)


def tree(num_slots: int = 64, window_slots: int = 64, page: int = 1):
    ws = WindowSlots(window_slots, W, max_reqs=4, max_context=256, device="cpu", prefill=8)
    windows = TreeWindows(ws)
    alloc = TokenAllocator(num_slots, page)
    cache = RadixCache(alloc, page, windows=windows)
    ws.evict = windows.evict
    return cache, ws, alloc


def window_of(ws: WindowSlots, n: int, held_from: int) -> torch.Tensor:
    """n positions' window slots, fresh from the pool from held_from on (dummy below)."""
    out = torch.full((n,), ws.dummy_slot, dtype=torch.int64)
    slots = ws.allocator.allocate(n - held_from)
    ws.refs[slots] = 1
    out[held_from:] = slots
    return out


def test_a_match_ends_where_the_window_is_held():
    cache, ws, alloc = tree()
    key = list(range(30))
    win = window_of(ws, 30, held_from=18)  # the inserting request held positions 18 .. 29
    cache.insert_path(key, alloc.allocate(30), win)
    ws.drop(win[18:])  # the request is gone: the tree is their one holder
    # a match of 30 reads the window [23, 30): held
    m = cache.match_prefix(key + [99])
    assert m.length == 30 and m.window_start == 23 and torch.equal(m.window, win[23:30])
    # a match of 20 reads [13, 20): 13 .. 17 are gone; cut back to a length whose window is
    # held: none below 18 + W - 1 but 0 ... and 25 .. 30 are all held for lengths >= 25
    m = cache.match_prefix(key[:20] + [99])
    assert m.length == 0 and m.last_node is cache.root
    m = cache.match_prefix(key[:27] + [99])
    assert m.length == 27 and m.window_start == 20
    # the walk cut the node at 20 and the window rule at 27: its child holds the rest
    assert m.last_node.key[-1] == 26 and len(m.last_node.children) == 1
    assert ws.check_integrity(cache.window_slots()) is None


def test_window_slots_count_their_holders_and_go_lru_first():
    cache, ws, alloc = tree(window_slots=40)
    a, b = list(range(100, 120)), list(range(200, 220))
    wa, wb = window_of(ws, 20, 0), window_of(ws, 20, 0)
    cache.insert_path(a, alloc.allocate(20), wa)
    cache.insert_path(b, alloc.allocate(20), wb)
    # a row holds b's last window (it matched b): those stay when the tree lets go
    m = cache.match_prefix(b + [1])
    ws.share(0, m.window_start, m.window)
    ws.drop(wa), ws.drop(wb)  # the inserting requests are gone
    assert ws.allocator.num_free == 0
    ws.check_integrity(cache.window_slots())
    # a is older: its 20 go first; then b's, of which the row's 7 stay
    assert ws.evict(25) == 20 + 13
    assert ws.allocator.num_free == 33
    assert cache.match_prefix(a + [1]).length == 0  # no window left anywhere on a
    assert cache.match_prefix(b + [1]).length == 0
    assert cache.match_prefix(b[:4] + [1]).length == 0
    ws.release(0)
    ws.check_integrity(cache.window_slots())
    assert ws.allocator.num_free == 40
    # the full slots stay in the tree; evicting the nodes drops nothing twice
    assert cache.evict(40) == 40
    ws.check_integrity(cache.window_slots())


def test_insert_fills_the_holes_and_split_cuts_the_window():
    cache, ws, alloc = tree()
    key = list(range(16))
    first = window_of(ws, 16, held_from=12)
    cache.insert_path(key, alloc.allocate(16), first)
    ws.drop(first[12:])
    second = window_of(ws, 16, held_from=2)  # a later request held more of the positions
    slots = alloc.allocate(16)
    assert cache.insert_path(key, slots, second)[0] == 16
    alloc.free(slots)
    node = cache.match_prefix(key, resumable=False).last_node
    assert torch.equal(node.window[2:12], second[2:12])  # the holes took the later slots
    assert torch.equal(node.window[12:], first[12:])  # held slots stay
    ws.drop(second[2:])  # the later request is gone: its duplicates at 12 .. 15 go back
    ws.check_integrity(cache.window_slots())
    m = cache.match_prefix(key[:10] + [7])  # splits the node at 10
    assert m.length == 10 and m.window_start == 3 and torch.equal(m.window, second[3:10])
    assert len(m.last_node.window) == 10 and len(m.last_node.children) == 1
    assert cache.match_prefix(key[:9] + [7]).length == 9  # reads [2, 9): held
    assert cache.match_prefix(key[:8] + [7]).length == 0  # reads [1, 8): 1 is not, nor 0
    ws.check_integrity(cache.window_slots())


class Sim:
    """A KVManager with windows driven like the scheduler drives it: admit a request with its
    match, reserve a chunk, 'write' its KV (content[slot] = the prefix the position ends), hand
    it to the tree, decode, release. Every step checks that a running request's window reads
    the KV of its own prefix."""

    def __init__(self, seed: int, num_slots: int, window_slots: int, page: int) -> None:
        self.rng = random.Random(seed)
        self.ws = WindowSlots(window_slots, W, max_reqs=4, max_context=512, device="cpu",
                              prefill=16)  # fmt: skip
        alloc = TokenAllocator(num_slots, page)
        cache = RadixCache(alloc, page, windows=TreeWindows(self.ws))
        self.kv = KVManager(alloc, cache, ReqToTokenPool(4, 512, "cpu"), self.ws)
        self.content = {}  # window slot -> the token prefix whose last position it holds
        self.stems = [[self.rng.randrange(50) for _ in range(self.rng.randint(4, 40))]
                      for _ in range(4)]  # fmt: skip
        self.running: list[Req] = []
        self.num = 0

    def new_req(self) -> Req:
        stem = self.rng.choice(self.stems)
        ids = stem[: self.rng.randint(1, len(stem))] + [
            self.rng.randrange(50) for _ in range(self.rng.randint(1, 30))
        ]
        self.num += 1
        params = SamplingParams(max_new_tokens=self.rng.randint(1, 12))
        return Req(str(self.num), 0, ids, params, 0)

    def write(self, req: Req, n: int) -> None:
        """The step's KV: each new position's window slot now holds its prefix."""
        seq = req.fill_ids
        for pos in range(req.kv_len, req.kv_len + n):
            self.content[int(self.ws.table_cpu[req.row, pos])] = tuple(seq[: pos + 1])

    def check_reads(self, req: Req) -> None:
        """The positions the request's next query reads, [kv_len - W + 1, kv_len)."""
        seq = req.fill_ids
        for pos in range(max(0, req.kv_len - W + 1), req.kv_len):
            slot = int(self.ws.table_cpu[req.row, pos])
            assert slot != self.ws.dummy_slot, f"{req.rid}: no window slot at {pos}"
            assert self.content[slot] == tuple(seq[: pos + 1]), f"{req.rid}: wrong KV at {pos}"

    def step(self) -> None:
        kv = self.kv
        if len(self.running) < 3 and self.rng.random() < 0.6:
            req = self.new_req()
            match = kv.match(req)
            if kv.admit(req, match):
                self.check_reads(req)
                n = min(req.num_pending, self.rng.choice([3, 9, 100]))
                if kv.reserve(req, n) is None:
                    kv.release(req)
                else:
                    self.write(req, n)
                    req.kv_len += n
                    kv.cache_unfinished(req)
                    self.running.append(req)
        for req in list(self.running):
            self.check_reads(req)
            if req.num_pending > 0:
                n = min(req.num_pending, self.rng.choice([2, 7, 100]))
                if kv.reserve(req, n) is None:
                    self.finish(req)
                    continue
                self.write(req, n)
                req.kv_len += n
                kv.cache_unfinished(req)
            elif len(req.output_ids) < req.params.max_new_tokens:
                req.output_ids.append(self.rng.randrange(50))
                if not kv.reserve_decodes([req]):
                    self.finish(req)
                    continue
                self.write(req, 1)
                req.kv_len += 1
            else:
                self.finish(req)
        kv.check_integrity()

    def finish(self, req: Req) -> None:
        self.running.remove(req)
        self.kv.release(req)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("page", [1, 4])
def test_random_requests_read_their_own_window(seed, page):
    sim = Sim(seed, num_slots=256, window_slots=3 * (W + 1) + 16 + 24, page=page)
    cached = 0
    for _ in range(300):
        sim.step()
        cached += sum(r.prefix_len > 0 for r in sim.running)
    for req in list(sim.running):
        sim.finish(req)
    sim.kv.check_integrity()
    assert cached > 0, "no request matched a cached prefix"
    assert sim.ws.num_held == 0
    sim.kv.cache.reset()
    sim.kv.check_integrity()
    assert sim.ws.allocator.num_free == sim.ws.capacity
