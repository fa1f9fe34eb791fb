"""The radix tree's window slots: the sliding layers' KV a cached prefix keeps.

With the window pool on (engine/window_pool.py) and the radix cache on, a tree node holds, beside
its full-pool slots, a window slot per position (`TreeNode.window`) or the pool's dummy slot
where the sliding layers' KV of that position is gone. A request hands the tree its span's slots
with its KV (`attach`, `fill`); the tree holds each as one more holder (WindowSlots.refs).

The rule (docs/gemma4.md): a sliding layer's query at position p reads keys p - W < k <= p, so a
match of length m resumes exactly only where the tree holds the window positions
[m - W + 1, m); `resumable` cuts a match back to the last such length (0 always is).

Eviction (`evict`): when the window pool is short, the nodes' window slots go in LRU order of
the nodes' last access (internal nodes and locked ones too: a running request holds the slots
of its own span itself, so dropping the tree's hold frees only what nobody reads); the node keeps
its full-pool slots, and a later match that would end in it is cut back. A node evicted from the
tree drops its window slots with it (`drop`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from batchrun.engine.radix_cache import TreeNode
    from batchrun.engine.window_pool import WindowSlots


class TreeWindows:
    def __init__(self, slots: WindowSlots) -> None:
        self.slots = slots
        self.window = slots.window
        self.dummy = slots.dummy_slot
        self.reset()

    def reset(self) -> None:
        """Forget the queue (the tree drops its nodes' slots itself, `drop`)."""
        # (last_access, seq, node) per node holding window slots; an entry whose node was
        # touched since is pushed again with the node's time when popped
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._seq = itertools.count()
        self._limit = 1024  # the heap's size that purges the entries of evicted nodes

    def empty(self, n: int) -> torch.Tensor:
        return torch.full((n,), self.dummy, dtype=torch.int64)

    # -- what nodes hold --------------------------------------------------------------------

    def attach(self, node: TreeNode, window: torch.Tensor) -> None:
        """A new node takes `window` (its positions' window slots, dummy where none)."""
        node.window = window.clone()
        held = window[window != self.dummy]
        if held.numel():
            self.slots.hold(held)
            self._push(node)

    def fill(self, node: TreeNode, offset: int, window: torch.Tensor) -> None:
        """An existing node's positions [offset, offset + len(window)) take the slots of
        `window` where the node has none (the slots it holds stay)."""
        part = node.window[offset : offset + window.numel()]
        holes = (part == self.dummy) & (window != self.dummy)
        if bool(holes.any()):
            self.slots.hold(window[holes])
            part[holes] = window[holes]
            self._push(node)

    def split(self, upper: TreeNode, lower: TreeNode, n: int) -> None:
        """`lower`'s edge was cut after n positions into `upper` and itself."""
        upper.window, lower.window = lower.window[:n], lower.window[n:]
        if bool((upper.window != self.dummy).any()):
            self._push(upper)

    def drop(self, node: TreeNode) -> int:
        """The node leaves the tree or gives its window up: its slots lose the tree's hold.
        Returns how many went back to the pool."""
        win = node.window
        held = win[win != self.dummy]
        node.window = self.empty(win.numel())
        return self.slots.drop(held)

    # -- matching ---------------------------------------------------------------------------

    def resumable(self, window: torch.Tensor, page: int) -> int:
        """The longest match length <= len(window) (a multiple of `page`) whose window the
        matched path holds; `window`: the path's window slots, position by position."""
        need = self.window - 1
        length = window.numel()
        while length > 0 and need > 0:
            lo = max(0, length - need)
            gone = window[lo:length] == self.dummy
            if not bool(gone.any()):
                break
            last = lo + int(gone.nonzero()[-1])  # the last position without its window
            length = last - last % page
        return length

    def span_of(self, window: torch.Tensor, length: int) -> tuple[int, torch.Tensor]:
        """(start, slots): the window slots of positions [length - W + 1, length) of a resumable
        match (what an admitted row's span starts with); `window` as for `resumable`."""
        start = max(0, length - self.window + 1)
        return start, window[start:length].clone()

    # -- eviction ---------------------------------------------------------------------------

    def evict(self, num_slots: int) -> int:
        """Give up nodes' window slots, least recently used first, until at least `num_slots`
        went back to the pool (or no node holds any). Returns how many did."""
        freed = 0
        while freed < num_slots and self._heap:
            when, _, node = heapq.heappop(self._heap)
            node.queued = False
            if node.removed or not bool((node.window != self.dummy).any()):
                continue
            if node.last_access != when:  # touched since: back in at its time
                self._push(node)
                continue
            freed += self.drop(node)
        return freed

    def _push(self, node: TreeNode) -> None:
        """Queue `node` (one entry a node; an evicted node's entry is purged by the rebuild)."""
        if node.queued:
            return
        node.queued = True
        heap = self._heap
        heapq.heappush(heap, (node.last_access, next(self._seq), node))
        if len(heap) > self._limit:
            self._heap = heap = [e for e in heap if not e[2].removed]
            heapq.heapify(heap)
            self._limit = 2 * len(heap) + 1024

    # -- checks -----------------------------------------------------------------------------

    def held_slots(self, nodes: Iterable[TreeNode]) -> torch.Tensor:
        """The window slots the tree's nodes hold (for WindowSlots.check_integrity)."""
        parts = []
        for node in nodes:
            assert node.window.numel() == len(node.key), f"{node!r}: window length differs"
            parts.append(node.window[node.window != self.dummy])
        return torch.cat(parts) if parts else self.empty(0)
