"""Prefix-aware request order: depth-first over the trie of the prompts' token ids.

A lexicographic sort of token-id sequences visits them in exactly the order of a depth-first walk
of their trie (children in ascending token order, a prompt before its extensions), so prompts that
share a prefix come out back to back and the radix cache computes each shared prefix once. No trie
is built: each prompt becomes one ``bytes`` key of its ids as big-endian uint32 (bytes compare
like the id sequences, with memcmp in C), about 4 bytes per token, and Python's sort orders them
(time and memory for a million prompts: docs/benchmarks.md, "CPU").

    keys = [sort_key(ids) for ids in prompts]
    order = dfs_order(keys)             # indices, DFS order
    reuse = reuse_lens([keys[i] for i in order])   # tokens an unlimited radix cache serves

A run orders windows of rows (``ordered_windows``) to bound memory; a run's shards or
data-parallel workers split so that prefix groups stay together (``shard_of`` when each reader
streams the whole input; ``split_ranges`` to cut one DFS order into contiguous parts).
"""

from __future__ import annotations

import bisect
import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")

ORDERS = ("prefix", "input")
DEFAULT_WINDOW = 100_000  # rows ordered together by a run (--order-window)
GROUP_DEPTH = 64  # tokens that define a prefix group when splitting into shards
_SWAP = sys.byteorder == "little"
assert array("I").itemsize == 4


# -- order -----------------------------------------------------------------------------------


def sort_key(ids: Sequence[int] | np.ndarray) -> bytes:
    """Big-endian uint32 bytes of ``ids``: compares like the id sequence (ids < 2**32)."""
    if isinstance(ids, np.ndarray):
        return ids.astype(">u4", copy=False).tobytes()
    a = array("I", ids)
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def packed_keys(tokens: np.ndarray, offsets: np.ndarray, chunk: int = 65_536) -> list[bytes]:
    """Sort keys of prompts stored flat (prompt i is ``tokens[offsets[i]:offsets[i+1]]``),
    converted a chunk of prompts at a time so the only full-size copy is the keys."""
    keys: list[bytes] = []
    for start in range(0, len(offsets) - 1, chunk):
        end = min(start + chunk, len(offsets) - 1)
        base = int(offsets[start])
        buf = tokens[base : int(offsets[end])].astype(">u4").tobytes()
        rel = ((offsets[start : end + 1] - base) * 4).tolist()
        keys.extend(buf[a:b] for a, b in zip(rel, rel[1:]))
    return keys


def dfs_order(keys: Sequence[bytes]) -> list[int]:
    """Indices of ``keys`` in DFS order of their trie; equal prompts keep their input order."""
    return sorted(range(len(keys)), key=keys.__getitem__)


def order_items(items: Sequence[T], ids_of: Callable[[T], Sequence[int]]) -> list[T]:
    keys = [sort_key(ids_of(item)) for item in items]
    return [items[i] for i in dfs_order(keys)]


def ordered_windows(
    items: Iterable[T], ids_of: Callable[[T], Sequence[int]], window: int = DEFAULT_WINDOW
) -> Iterator[T]:
    """``items`` in DFS order within consecutive windows of ``window`` items (bounded memory:
    one window of items and keys at a time)."""
    if window < 1:
        raise ValueError(f"window must be >= 1; got {window}")
    buf: list[T] = []
    for item in items:
        buf.append(item)
        if len(buf) >= window:
            yield from order_items(buf, ids_of)
            buf = []
    if buf:
        yield from order_items(buf, ids_of)


# -- what a prefix cache reuses --------------------------------------------------------------


def common_prefix_len(a: bytes, b: bytes) -> int:
    """Common prefix of two sort keys, in tokens."""
    n = min(len(a), len(b)) // 4
    if a[: 4 * n] == b[: 4 * n]:
        return n
    x = np.frombuffer(a, np.uint32, n)
    y = np.frombuffer(b, np.uint32, n)
    return int((x != y).argmax())


def reuse_lens(sorted_keys: Sequence[bytes]) -> np.ndarray:
    """Per prompt in DFS order, the tokens an unlimited radix cache serves it: its common prefix
    with the previous prompt (the longest with any earlier one, in this order), at most its
    length - 1 (the engine always computes the last prompt token). Their sum is what any order
    reuses with an unlimited cache: all prompt tokens minus the trie's nodes."""
    out = np.zeros(len(sorted_keys), dtype=np.int64)
    for i in range(1, len(sorted_keys)):
        key = sorted_keys[i]
        out[i] = min(common_prefix_len(sorted_keys[i - 1], key), len(key) // 4 - 1)
    return out


def snapshot_reuse_lens(sorted_keys: Sequence[bytes], lookahead: int, min_len: int) -> np.ndarray:
    """Per prompt in DFS order, the tokens an unlimited radix cache serves it on a hybrid model,
    whose matches end at state snapshots (batchrun/engine/state_snapshots.py): each prompt
    snapshots its common prefix with each of the next ``lookahead`` prompts (at most that
    prompt's length - 1) where that is at least ``min_len`` tokens past the prompt's own hit, and
    a prompt's hit is the deepest snapshot on its path (at most its length - 1)."""
    n = len(sorted_keys)
    lens = [len(k) // 4 for k in sorted_keys]
    lcp = [0] + [common_prefix_len(sorted_keys[i - 1], sorted_keys[i]) for i in range(1, n)]
    out = np.zeros(n, dtype=np.int64)
    path: list[int] = []  # snapshot depths on the current prompt's path, ascending
    for i in range(n):
        while path and path[-1] > lcp[i]:
            path.pop()
        j = bisect.bisect_right(path, lens[i] - 1)
        hit = path[j - 1] if j else 0
        out[i] = hit
        shared = lens[i]
        for m in range(i + 1, min(n, i + 1 + lookahead)):
            shared = min(shared, lcp[m])  # the common prefix of prompts i and m
            if shared < hit + min_len:
                break
            b = min(shared, lens[m] - 1)
            if b >= hit + min_len:
                k = bisect.bisect_left(path, b)
                if k == len(path) or path[k] != b:
                    path.insert(k, b)
    return out


class LRUEstimate:
    """Approximate prefix-cache hits of a stream of prompts (in run order) for a KV budget.

    NOTE: an approximation, not the scheduler: an LRU cache of ``capacity`` tokens in blocks of
    ``block`` tokens (a block is keyed by a hash of the whole prefix up to it); each prompt's
    matched leading blocks are hits, then its blocks and its output (``num_out`` tokens) are
    cached as a finished request's would be, children older than parents so that, as in the
    radix tree, leaves go first. Requests running at once and the scheduler's reservations are
    not modelled. ``hits`` counts whole blocks; ``predicted`` rescales it by the exact figure.
    """

    def __init__(self, capacity: int, block: int = 16):
        self.capacity = capacity
        self.block = block
        self.hits = 0  # tokens, whole blocks
        self._lru: OrderedDict[object, int] = OrderedDict()  # key -> size in tokens
        self._size = 0
        self._next_private = 0

    def feed(self, key: bytes, num_out: int) -> int:
        step = 4 * self.block
        usable = len(key) // 4 - 1  # the engine computes the last token
        num_blocks = usable // self.block
        hashes, h, hit = [], 0, 0
        for i in range(num_blocks):
            h = hash((h, key[i * step : (i + 1) * step]))
            hashes.append(h)
        lru = self._lru
        while hit < num_blocks and hashes[hit] in lru:
            hit += 1
        # the request's own tokens: private tail + output, then its blocks deepest first
        self._next_private -= 1
        private = len(key) // 4 - num_blocks * self.block + num_out
        self._put(self._next_private, private)
        for h in reversed(hashes):
            self._put(h, self.block)
        self._evict()
        self.hits += hit * self.block
        return hit * self.block

    def _put(self, k: object, size: int) -> None:
        if k in self._lru:
            self._lru.move_to_end(k)
        else:
            self._lru[k] = size
            self._size += size

    def _evict(self) -> None:
        while self._size > self.capacity and self._lru:
            self._size -= self._lru.popitem(last=False)[1]


def predicted_reuse(exact_unlimited: int, sim_hits: int, block_reuse_unlimited: int) -> float:
    """Tokens reused under a budget: the exact unlimited figure scaled by the simulated share of
    the block-granular unlimited one (which cancels most of the block rounding)."""
    if block_reuse_unlimited <= 0:
        return float(exact_unlimited)
    return exact_unlimited * min(1.0, sim_hits / block_reuse_unlimited)


# -- splitting into shards that keep prefix groups together --------------------------------


def prefix_group_key(ids: Sequence[int] | np.ndarray, depth: int = GROUP_DEPTH) -> int:
    """A stable 64-bit key of the first ``depth`` tokens: prompts that share them (a prefix
    group) get the same key in every process and on every node (no salted ``hash``)."""
    head = sort_key(ids[:depth])
    return int.from_bytes(hashlib.blake2b(head, digest_size=8).digest(), "little")


def shard_of(ids: Sequence[int] | np.ndarray, num_shards: int, depth: int = GROUP_DEPTH) -> int:
    """The shard of a prompt when every shard streams the whole input and keeps its own rows:
    a whole prefix group (same first ``depth`` tokens) goes to one shard. Groups longer than
    ``depth`` stay together; prompts shorter than ``depth`` group by their whole ids."""
    return prefix_group_key(ids, depth) % num_shards


def split_ranges(
    sorted_keys: Sequence[bytes], num_shards: int, depth: int = GROUP_DEPTH
) -> list[tuple[int, int]]:
    """Cut a DFS order into ``num_shards`` contiguous ranges ``[start, end)`` of about equal
    size, each cut moved to the nearest prefix-group boundary (a prompt sharing fewer than
    ``depth`` tokens with its predecessor), so no group of ``depth`` shared tokens is cut unless
    one group is larger than a shard. Ranges may be empty; together they cover every index."""
    n = len(sorted_keys)
    cuts = [0]
    for s in range(1, num_shards):
        target = max(cuts[-1], round(s * n / num_shards))
        cuts.append(_nearest_boundary(sorted_keys, target, cuts[-1], depth))
    cuts.append(n)
    return list(zip(cuts, cuts[1:]))


def _nearest_boundary(keys: Sequence[bytes], target: int, low: int, depth: int) -> int:
    n = len(keys)

    def is_boundary(i: int) -> bool:
        return i <= 0 or i >= n or common_prefix_len(keys[i - 1], keys[i]) < depth

    for dist in range(n + 1):
        for i in (target - dist, target + dist):
            if low <= i <= n and is_boundary(i):
                return i
    return target  # unreachable: n is a boundary
