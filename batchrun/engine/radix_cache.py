"""Radix tree over token ids whose nodes own KV slots (the prefix cache).

Each node holds an edge ``key`` (token ids) and the KV slots ``value`` of those tokens; the path
from the root spells a cached prefix. Nodes are reference counted by running requests
(``lock``/``unlock``); unlocked leaves are evicted in LRU order and their slots go back to the
allocator.

With ``page_size`` P > 1 every edge length is a multiple of P, children are keyed by their first
page (a tuple of P ids) and matches are truncated to whole pages, so the slots of a node are
always whole pages of the allocator.

A hybrid model's cache (``snapshots`` given, engine/state_snapshots.py) also needs the linear
layers' state at the end of a match: a node may carry a state snapshot (of the path up to its
end), a match is cut back to the deepest node with one, and a node evicted frees its snapshot.

A model whose sliding layers keep only their window (engine/window_pool.py, ``windows`` given,
engine/window_tree.py) has a node hold its positions' window slots too: a match is cut back to
the deepest length whose window the path still holds, and the window slots go LRU first when
the window pool is short.

Ownership when a finished request is cached (indices into its token ids)::

    0            m.length          n_dup = insert(...)        aligned       len
    |-- matched -----|-- computed, tree had them -|-- new, tree takes --|-- tail --|
       (tree's)         (caller frees)                (tree owns)        (caller frees)
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from batchrun.engine.allocator import TokenAllocator

if TYPE_CHECKING:
    from batchrun.engine.state_snapshots import StateSnapshots
    from batchrun.engine.window_tree import TreeWindows

__all__ = ["MatchResult", "RadixCache", "TreeNode"]

_EMPTY = torch.empty(0, dtype=torch.int64)
# Below this many tokens a Python loop beats building numpy arrays to find a mismatch.
_NUMPY_MIN_LEN = 64


class TreeNode:
    __slots__ = (
        "key", "value", "parent", "children", "ref", "last_access", "id", "removed", "snapshot",
        "window", "queued",
    )  # fmt: skip
    _ids = itertools.count()

    def __init__(self, key: tuple[int, ...], value: torch.Tensor, parent: TreeNode | None) -> None:
        self.key = key
        self.value = value  # int64 [len(key)] slot ids
        self.parent = parent
        self.children: dict[object, TreeNode] = {}
        self.ref = 0
        self.last_access = 0
        self.id = next(TreeNode._ids)  # tie-breaker for the eviction heap
        self.removed = False  # evicted: its heap entries are dead
        self.snapshot: int | None = None  # state snapshot slot (hybrids: state_snapshots.py)
        self.window: torch.Tensor = _EMPTY  # window slot a position (window_tree.py), or none
        self.queued = False  # in the window eviction queue (window_tree.py)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, ref={self.ref})"


class MatchResult(NamedTuple):
    slots: torch.Tensor  # int64 [L] slot ids of the matched prefix, L page-aligned
    last_node: TreeNode  # deepest matched node (root if none); pass to lock/unlock
    # with windows: the window slots of positions [window_start, L) (a row's span begins so)
    window_start: int = 0
    window: torch.Tensor = _EMPTY

    @property
    def length(self) -> int:
        return self.slots.numel()


def _common_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common prefix of two token tuples."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case (full edge match) stays in C
        return n
    if n >= _NUMPY_MIN_LEN:
        diff = np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64)
        return int(diff.argmax())
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n  # unreachable: the slices differed


class RadixCache:
    def __init__(
        self,
        allocator: TokenAllocator,
        page_size: int = 1,
        disable: bool = False,
        snapshots: StateSnapshots | None = None,
        windows: TreeWindows | None = None,
    ) -> None:
        if page_size != allocator.page_size:
            raise ValueError(
                f"page_size={page_size} differs from allocator.page_size={allocator.page_size}"
            )
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self.snapshots = snapshots  # a hybrid model's: matches end at a snapshot
        self.windows = windows  # sliding layers' windows: matches end where one is held
        self.reset()

    def reset(self) -> None:
        """Drop every node and give its slots back to the allocator.

        NOTE: slots go back through `allocator.free`, so call this *before* `allocator.reset()`
        (or instead of it); calling it after would free slots twice. Locks are dropped too: only
        reset when no request holds a match.
        """
        root = getattr(self, "root", None)
        if root is not None:
            nodes = [n for n in self._iter_nodes() if not n.is_root]
            if nodes:
                self.allocator.free(torch.cat([n.value for n in nodes]))
            if self.windows is not None:
                for node in nodes:
                    self.windows.drop(node)
        if self.snapshots is not None:
            self.snapshots.reset()
        if self.windows is not None:
            self.windows.reset()
        self.root = TreeNode((), _EMPTY, None)
        self.root.ref = 1  # never evicted, never counted
        self._evictable_size = 0
        self._protected_size = 0
        self._clock = 0
        # NOTE: the eviction heap lives with the tree: an entry (last_access, id, seq, node) is
        # pushed whenever a node may be an unlocked leaf with that access time, and checked when
        # popped (still in the tree, a leaf, unlocked, not touched since), so an eviction costs
        # O(log n) per entry popped; a walk of the whole tree would cost O(tree) on every step
        # once the pool is full. seq breaks ties between two entries of one node.
        self._heap: list[tuple[int, int, int, TreeNode]] = []
        self._seq = itertools.count()
        self._num_nodes = 0

    # -- sizes ------------------------------------------------------------------------------

    @property
    def evictable_size(self) -> int:
        return self._evictable_size

    @property
    def protected_size(self) -> int:
        return self._protected_size

    @property
    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    # -- lookup and insertion -------------------------------------------------------------

    def match_prefix(self, key: Sequence[int], resumable: bool = True) -> MatchResult:
        """Longest cached prefix of ``key`` in whole pages; refreshes LRU along the path. With
        ``resumable``, cut back to where the model can go on from: with snapshots, the deepest
        node with one; with windows, the deepest length whose window the path holds."""
        if self.disable:
            return MatchResult(_EMPTY, self.root)
        end = self._page_floor(len(key))
        node, pos, values = self.root, 0, []
        path: list[TreeNode] = []
        now = self._tick()
        # NOTE: only the edges walked are made tuples (a miss at the root costs O(1), not O(len))
        while pos < end:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            self._touch(child, now)
            edge = tuple(key[pos : min(pos + len(child.key), end)])
            n = self._page_floor(_common_len(child.key, edge))
            partial = n < len(child.key)
            if partial:
                child = self._split(child, n)
            values.append(child.value)
            path.append(child)
            node, pos = child, pos + n
            if partial:
                break
        if self.snapshots is not None and resumable:
            # NOTE: the KV past the deepest snapshot cannot resume the linear layers
            keep = len(path)
            while keep and path[keep - 1].snapshot is None:
                keep -= 1
            node = path[keep - 1] if keep else self.root
            del values[keep:]
        if self.windows is not None and path:
            return self._match_windows(path, values, resumable)
        slots = torch.cat(values) if values else _EMPTY
        return MatchResult(slots, node)

    def _match_windows(
        self, path: list[TreeNode], values: list[torch.Tensor], resumable: bool
    ) -> MatchResult:
        """The match of `path` with its window (window_tree.py), cut back with `resumable` to
        the deepest length whose window the path holds (splitting the node it ends in)."""
        window = torch.cat([n.window for n in path])
        length = window.numel()
        if resumable:
            length = self.windows.resumable(window, self.page_size)
            if length == 0:
                return MatchResult(_EMPTY, self.root)
            k = end = 0  # path[k] holds position length - 1 and starts at `end`
            while end + len(path[k].key) < length:
                end += len(path[k].key)
                k += 1
            if end + len(path[k].key) > length:
                path[k] = self._split(path[k], length - end)
                values[k] = path[k].value
            del path[k + 1 :], values[k + 1 :]
        start, span = self.windows.span_of(window, length)
        slots = torch.cat(values) if len(values) > 1 else values[0]
        return MatchResult(slots, path[-1], start, span)

    def insert(self, key: Sequence[int], slots: torch.Tensor) -> int:
        """Cache ``key`` -> ``slots``; return how many leading tokens the tree already had.

        The caller keeps ownership of ``slots[:returned]`` (and frees the ones it allocated
        itself); the tree takes ``slots[returned:]``. Disabled caches keep nothing and return
        ``len(key)`` so the caller frees everything.
        """
        return self.insert_path(key, slots)[0]

    def insert_path(
        self, key: Sequence[int], slots: torch.Tensor, window: torch.Tensor | None = None
    ) -> tuple[int, TreeNode]:
        """`insert`, also returning the node where ``key`` ends (the root if disabled or empty):
        what `match_prefix(key).last_node` would be right after, without a second walk. With
        windows, ``window`` gives each position's window slot (dummy where none): the tree holds
        them where it has none (window_tree.py)."""
        if self.disable:
            return len(key), self.root
        if len(key) != slots.numel():
            raise ValueError(f"len(key)={len(key)} != len(slots)={slots.numel()}")
        if len(key) % self.page_size:
            raise ValueError(f"len(key)={len(key)} is not a multiple of {self.page_size}")
        key = tuple(key)
        windows = self.windows
        if windows is not None and window is None:
            window = windows.empty(len(key))
        node, pos = self.root, 0
        now = self._tick()
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            self._touch(child, now)
            n = self._page_floor(_common_len(child.key, key[pos : pos + len(child.key)]))
            if n < len(child.key):
                # The remainder of `key` diverges inside this edge (or ends there): split, and the
                # loop stops at the new node because no child starts with key[pos + n:].
                child = self._split(child, n)
            if windows is not None:
                windows.fill(child, 0, window[pos : pos + n])
            node, pos = child, pos + n
        num_existing = pos
        if pos < len(key):
            # NOTE: clone so the tree never aliases the caller's buffer (a req-to-token row).
            leaf = TreeNode(key[pos:], slots[pos:].to(torch.int64).clone(), node)
            node.children[self._child_key(leaf.key, 0)] = leaf
            self._num_nodes += 1
            self._evictable_size += len(leaf.key)
            self._touch(leaf, now)
            if windows is not None:
                windows.attach(leaf, window[pos:])
            node = leaf
        return num_existing, node

    # -- reference counting ---------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction."""
        while not node.is_root:
            if node.ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
            node.ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while not node.is_root:
            assert node.ref > 0, f"unlock of unlocked node {node!r}"
            node.ref -= 1
            if node.ref == 0:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                if not node.children:
                    self._push(node)
            node = node.parent

    # -- eviction ---------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots (if possible) from LRU unlocked leaves."""
        if self.disable or num_tokens <= 0:
            return 0
        heap = self._heap
        freed, values = 0, []
        while freed < num_tokens and heap:
            last_access, _, _, node = heapq.heappop(heap)
            # (last_access, id) order over the unlocked leaves, as a fresh heap of them would pop
            if node.removed or node.children or node.ref or node.last_access != last_access:
                continue  # a dead entry: evicted, grown a child, locked or touched since
            parent = node.parent
            del parent.children[self._child_key(node.key, 0)]
            node.removed = True
            if node.snapshot is not None:
                self.snapshots.drop(node)
            if self.windows is not None:
                self.windows.drop(node)
            self._num_nodes -= 1
            values.append(node.value)
            freed += len(node.key)
            self._evictable_size -= len(node.key)
            if not parent.is_root and not parent.children and parent.ref == 0:
                self._push(parent)
        if values:
            self.allocator.free(torch.cat(values))  # one free call for the whole batch
        return freed

    def _touch(self, node: TreeNode, now: int) -> None:
        node.last_access = now
        if not node.children:
            self._push(node)

    def _push(self, node: TreeNode) -> None:
        heap = self._heap
        heapq.heappush(heap, (node.last_access, node.id, next(self._seq), node))
        if len(heap) > 4 * self._num_nodes + 1024:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        """Drop the dead entries: one entry per unlocked leaf."""
        self._heap = [
            (n.last_access, n.id, next(self._seq), n)
            for n in self._iter_nodes()
            if not n.children and n.ref == 0 and not n.is_root
        ]
        heapq.heapify(self._heap)

    # -- debugging --------------------------------------------------------------------------

    def window_slots(self) -> torch.Tensor:
        """The window slots the nodes hold (for the window pool's integrity check)."""
        return self.windows.held_slots(n for n in self._iter_nodes() if not n.is_root)

    def check_integrity(self, num_in_use: int) -> None:
        """Assert tree invariants and ``free + cached + in use == capacity``."""
        alloc = self.allocator
        P = self.page_size
        evictable = protected = 0
        values = []
        for node in self._iter_nodes():
            for ck, child in node.children.items():
                assert child.parent is node, f"{child!r}: parent pointer wrong"
                assert self._child_key(child.key, 0) == ck, f"{child!r}: filed under wrong key"
                assert child.ref <= node.ref or node.is_root, (
                    f"{child!r} has ref {child.ref} > parent {node!r} ref {node.ref}"
                )
            if node.is_root:
                continue
            assert node.ref >= 0, f"{node!r}: negative ref"
            assert len(node.key) > 0, f"{node!r}: empty edge"
            assert len(node.key) == node.value.numel(), (
                f"{node!r}: key len {len(node.key)} != value len {node.value.numel()}"
            )
            assert len(node.key) % P == 0, f"{node!r}: edge not page-aligned (P={P})"
            if node.ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
            values.append(node.value)
        assert evictable == self._evictable_size, (
            f"evictable_size {self._evictable_size} != recount {evictable}"
        )
        live = {
            n.id
            for last_access, _, _, n in self._heap
            if not n.removed and n.last_access == last_access
        }
        for node in self._iter_nodes():
            if not node.is_root and not node.children and node.ref == 0:
                assert node.id in live, f"{node!r}: unlocked leaf missing from the eviction heap"
        assert self._num_nodes == sum(1 for _ in self._iter_nodes()) - 1, "node count drifted"
        assert protected == self._protected_size, (
            f"protected_size {self._protected_size} != recount {protected}"
        )
        if self.snapshots is not None:
            self.snapshots.check_integrity(n for n in self._iter_nodes() if not n.is_root)
        else:
            assert all(n.snapshot is None for n in self._iter_nodes()), "snapshot without a pool"
        tree_slots = torch.cat(values) if values else _EMPTY
        assert torch.unique(tree_slots).numel() == tree_slots.numel(), "slot owned twice in tree"
        if P > 1 and tree_slots.numel():
            pages = tree_slots.view(-1, P)
            assert bool((pages[:, 0] % P == 0).all()), "tree holds a non page-aligned slot run"
            assert bool((pages - pages[:, :1] == torch.arange(P)).all()), "tree page not contiguous"
        alloc.check_no_double_free()
        overlap = torch.isin(tree_slots, alloc.free_slots())
        assert not bool(overlap.any()), (
            f"tree slots also free in allocator: {tree_slots[overlap][:8].tolist()}"
        )
        total = alloc.num_free + self.total_size + num_in_use
        assert total == alloc.capacity, (
            f"slot leak: free {alloc.num_free} + cached {self.total_size} + in use {num_in_use} "
            f"= {total} != capacity {alloc.capacity}"
        )

    def pretty(self) -> str:
        lines = [
            f"RadixCache(P={self.page_size}, evictable={self._evictable_size}, "
            f"protected={self._protected_size})"
        ]

        def walk(node: TreeNode, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda c: c.id):
                head = list(child.key[:8]) + (["..."] if len(child.key) > 8 else [])
                lines.append(
                    f"{'  ' * depth}- {head} len={len(child.key)} ref={child.ref} "
                    f"t={child.last_access} slots={child.value[:8].tolist()}"
                    + (f" snapshot={child.snapshot}" if child.snapshot is not None else "")
                )
                walk(child, depth + 1)

        walk(self.root, 1)
        return "\n".join(lines)

    # -- internals --------------------------------------------------------------------------

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child``'s edge after ``n`` tokens; return the new upper node (0 < n < len)."""
        upper = TreeNode(child.key[:n], child.value[:n], child.parent)
        self._num_nodes += 1
        # Both halves keep the lock count and access time: the same requests still hold them.
        upper.ref = child.ref
        upper.last_access = child.last_access
        upper.parent.children[self._child_key(upper.key, 0)] = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = upper
        if self.windows is not None:
            self.windows.split(upper, child, n)
        upper.children[self._child_key(child.key, 0)] = child
        return upper

    def _child_key(self, key: Sequence[int], pos: int) -> object:
        # Page size 1: a plain int hashes faster than a 1-tuple.
        if self.page_size == 1:
            return key[pos]
        return tuple(key[pos : pos + self.page_size])

    def _page_floor(self, n: int) -> int:
        return n - n % self.page_size

    def _tick(self) -> int:
        # NOTE: a counter, not wall time: deterministic LRU order in tests, no ties on fast hosts.
        self._clock += 1
        return self._clock

    def _iter_nodes(self) -> Iterator[TreeNode]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
