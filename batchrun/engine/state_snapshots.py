"""State snapshots: the radix cache's copies of a hybrid model's linear-layer states.

A row that matches a cached prefix needs the KV of the prefix (the radix tree's slots) and, for
each linear-attention layer, the recurrent state after the prefix (conv + delta state). KV is
kept for every token; a state only where a snapshot was taken:

    conv [num_linear_layers, num_snapshots, conv_dim, K-1]     as StatePool's, a slot a snapshot
    ssm  [num_linear_layers, num_snapshots, Hv, Dk, Dv]

A snapshot belongs to one radix node (`TreeNode.snapshot`, its slot here) and holds the state
after the tokens of the path from the root to that node's end. The radix cache cuts a hybrid's
match back to the deepest node with a snapshot; eviction of a node frees its snapshot.

Where snapshots are taken (the scheduler's rule, `boundaries`): at admission, a request looks
at the next SNAPSHOT_LOOKAHEAD waiting requests (the queue is in prefix DFS order,
batchrun/job/order.py) and takes a snapshot where its prompt stops sharing tokens with each of
them, where they share at least MIN_SNAPSHOT_PREFIX tokens beyond what it matched; its prefill
chunks end at those boundaries. A retracted request keeps a snapshot at its computed length.
batchrun/job/order.py's `snapshot_reuse_lens` predicts the hits of this rule.

Memory rule (docs/hybrid.md, "Prefix caching"): one snapshot for every SNAPSHOT_ROWS state
slots, at least MIN_SNAPSHOTS; their bytes come off the memory budget with the state slots',
before the KV pool. When none is free, a new snapshot takes the slot of the least recently
used snapshot whose node no request holds, or is not taken.

Copies run on the device in the order they are called (the step's stream), as the scheduler
calls them: a snapshot saved after a step's launch holds that step's state, and a row loaded at
admission runs its first step from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from batchrun.engine.state_pool import StatePool

if TYPE_CHECKING:
    from batchrun.engine.radix_cache import TreeNode

__all__ = [
    "MIN_SNAPSHOTS",
    "MIN_SNAPSHOT_PREFIX",
    "SNAPSHOT_LOOKAHEAD",
    "SNAPSHOT_ROWS",
    "StateSnapshots",
    "boundaries",
    "num_snapshots",
]

SNAPSHOT_ROWS = 8  # state slots per snapshot slot
MIN_SNAPSHOTS = 4
# waiting requests a request admitted compares its prompt with (its snapshot boundaries)
SNAPSHOT_LOOKAHEAD = 8
# fewer shared tokens past a request's own hit are recomputed rather than snapshotted; the
# scheduler's hold rule (MIN_SHARED_PREFIX) uses the same count, so a follower that would hit a
# boundary waits for it
MIN_SNAPSHOT_PREFIX = 16


def num_snapshots(max_running: int) -> int:
    """The snapshot pool's slots beside `max_running + 1` state slots."""
    return max(MIN_SNAPSHOTS, (max_running + 1) // SNAPSHOT_ROWS)


def boundaries(
    ids: Sequence[int], start: int, followers: Iterable[Sequence[int]], page: int = 1
) -> tuple[int, ...]:
    """Ascending token counts of `ids` after which a request that starts at `start` saves its
    state: its common prefix with each follower (at most the follower's length - 1, what the
    follower may match; page-floored) where it is at least MIN_SNAPSHOT_PREFIX tokens past
    `start`."""
    out = set()
    for other in followers:
        n = min(len(ids), len(other) - 1)
        least = start + MIN_SNAPSHOT_PREFIX
        if n < least or ids[:MIN_SNAPSHOT_PREFIX] != other[:MIN_SNAPSHOT_PREFIX]:
            continue
        b = common_prefix_len(ids, other, n)
        b -= b % page
        if b >= least:
            out.add(b)
    return tuple(sorted(out))


def common_prefix_len(a: Sequence[int], b: Sequence[int], n: int | None = None) -> int:
    """Length of the common prefix of a[:n] and b[:n] (n: the shorter length); slice
    comparisons run in C, so O(log n) Python steps."""
    n = min(len(a), len(b)) if n is None else n
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class StateSnapshots:
    def __init__(self, states: StatePool, capacity: int):
        """Unallocated until `allocate` (after the state pool's)."""
        if capacity < 1:
            raise ValueError(f"a snapshot pool needs at least one slot; got {capacity}")
        self.states = states
        self.capacity = capacity
        self.conv: torch.Tensor | None = None
        self.ssm: torch.Tensor | None = None
        self._free = list(range(capacity - 1, -1, -1))
        self._owners: dict[int, TreeNode] = {}
        self.num_saved = 0
        self.num_loaded = 0
        self.num_replaced = 0  # snapshots dropped to make room for a newer one

    @property
    def num_free(self) -> int:
        return len(self._free)

    def bytes(self, dtype: str = "float32") -> int:
        """The pool's bytes with states of `dtype` (EngineConfig.linear_state_dtype)."""
        return self.capacity * self.states.bytes_per_row(dtype)

    def allocate(self) -> None:
        conv, ssm = self.states.conv, self.states.ssm
        assert conv is not None and ssm is not None, "allocate the state pool first"
        self.conv = conv.new_zeros((conv.shape[0], self.capacity, *conv.shape[2:]))
        self.ssm = ssm.new_zeros((ssm.shape[0], self.capacity, *ssm.shape[2:]))

    # -- copies (device, in call order) ------------------------------------------------------

    def save(self, row: int, node: TreeNode) -> bool:
        """Snapshot state row `row` at `node` (a node that has one keeps it); False when no
        slot can be had."""
        if node.snapshot is not None:
            return True
        slot = self._take()
        if slot is None:
            return False
        self.conv[:, slot].copy_(self.states.conv[:, row])
        self.ssm[:, slot].copy_(self.states.ssm[:, row])
        node.snapshot = slot
        self._owners[slot] = node
        self.num_saved += 1
        return True

    def load(self, node: TreeNode, row: int) -> None:
        """State row `row` from `node`'s snapshot."""
        slot = node.snapshot
        assert slot is not None, f"{node!r} holds no snapshot"
        self.states.conv[:, row].copy_(self.conv[:, slot])
        self.states.ssm[:, row].copy_(self.ssm[:, slot])
        self.num_loaded += 1

    # -- slots (host) ------------------------------------------------------------------------

    def drop(self, node: TreeNode) -> None:
        """`node` leaves the tree: its snapshot's slot is free."""
        slot = node.snapshot
        if slot is None:
            return
        del self._owners[slot]
        node.snapshot = None
        self._free.append(slot)

    def reset(self) -> None:
        for node in list(self._owners.values()):
            self.drop(node)

    def _take(self) -> int | None:
        if self._free:
            return self._free.pop()
        unlocked = [n for n in self._owners.values() if n.ref == 0]
        if not unlocked:
            return None
        victim = min(unlocked, key=lambda n: (n.last_access, n.id))
        self.drop(victim)
        self.num_replaced += 1
        return self._free.pop()

    def check_integrity(self, nodes: Iterable[TreeNode]) -> None:
        held = {n.snapshot: n for n in nodes if n.snapshot is not None}
        assert held == self._owners, "snapshot owners drifted from the tree"
        assert len(set(self._free)) == len(self._free), "snapshot slot free twice"
        assert not set(self._free) & set(held), "snapshot slot both free and held"
        assert len(self._free) + len(held) == self.capacity, (
            f"snapshot leak: free {len(self._free)} + held {len(held)} != {self.capacity}"
        )
