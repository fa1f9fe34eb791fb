"""A compact set of row ids, with the row that brought each id first: duplicates in inputs of
hundreds of millions of rows, found while streaming them.

An id is kept as 96 bits of its BLAKE2b digest (a 64-bit key, 0 meaning an empty slot, and a
32-bit check) plus its first row number (uint32; the array widens to int64 past 2**32 - 1
rows), in numpy arrays under open addressing: linear probing over a power-of-two table at most
3/4 full. That is 16 bytes a slot: 2 GiB for 100M ids (2**27 slots), 3 GiB for the moment
the table doubles (it is rehashed chunk by chunk, so nothing else grows with it). Its time
and memory: docs/benchmarks.md, "CPU".

NOTE: false positives. Two different ids look alike only when all 96 bits agree: with n ids the
chance that any pair does is about n**2 / 2**97, 6e-14 for 100M ids and 6e-12 for 1G. A 64-bit
key alone would give 3e-4 at 100M: a row in a few thousand 100M-row jobs would be refused as a
duplicate it is not. The digest is keyed by nothing, so every process (every shard, every
resumed attempt) finds the same duplicates in the same input.
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

import numpy as np

_WINDOW = np.arange(32, dtype=np.int64)  # the widest window of slots read in a probe round
_REHASH_CHUNK = 1 << 16  # old slots moved per step while the table doubles
_ROW32_MAX = (1 << 32) - 1


def hash_ids(ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(key uint64 [N], check uint32 [N]) from the BLAKE2b digests of `ids` (never key 0)."""
    digests = b"".join(
        [blake2b(i.encode("utf-8", "surrogatepass"), digest_size=16).digest() for i in ids]
    )
    words = np.frombuffer(digests, dtype="<u8").reshape(-1, 2)  # [N, 2]
    key = words[:, 0] | (words[:, 0] == 0)  # 0 marks an empty slot: hash 0 becomes 1
    check = (words[:, 1] & np.uint64(_ROW32_MAX)).astype(np.uint32)
    return key, check


class IdSet:
    """Ids seen so far, each with the row number of its first occurrence."""

    def __init__(self, capacity: int = 1024) -> None:
        self._alloc(1 << max(4, (capacity - 1).bit_length()), np.uint32)
        self._count = 0

    def _alloc(self, capacity: int, row_dtype: type) -> None:
        self._keys = np.zeros(capacity, dtype=np.uint64)
        self._check = np.zeros(capacity, dtype=np.uint32)
        self._rows = np.zeros(capacity, dtype=row_dtype)
        self._mask = capacity - 1

    def __len__(self) -> int:
        return self._count

    @property
    def capacity(self) -> int:
        return len(self._keys)

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._check.nbytes + self._rows.nbytes

    def add(self, ids: Sequence[str], rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """Add `ids` (in input order) with their row numbers. Returns, for each, the row of its
        first occurrence (an earlier call, or earlier in this one), or -1 when it is new."""
        return self.add_hashed(*hash_ids(ids), np.asarray(rows, dtype=np.int64))

    def add_hashed(self, key: np.ndarray, check: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """As `add`, with the ids given as hash_ids' (key, check)."""
        if len(key) == 0:
            return np.zeros(0, dtype=np.int64)
        if self._rows.dtype == np.uint32 and rows.max() > _ROW32_MAX:
            self._rows = self._rows.astype(np.int64)
        needed = self._count + len(key)
        if needed * 4 > self.capacity * 3:
            self._grow(needed)
        return self._place(key, check, rows)

    def _place(self, key: np.ndarray, check: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Probe for every id at once, round by round (linear probing, a window of slots a
        round, widening). Equal ids probe in lockstep, so the first of them in `key` takes the
        slot and the others find it the round after."""
        found = np.full(len(key), -1, dtype=np.int64)
        pos = (key & np.uint64(self._mask)).astype(np.int64)  # home slots
        todo = np.arange(len(key))
        width = 1  # most ids end at their home slot; stragglers get wider windows
        while len(todo):
            # the first slot of the window that is empty or holds the id ends its probe
            win = (pos[todo][:, None] + _WINDOW[:width]) & self._mask  # [T, width]
            slot_keys = self._keys[win]
            same = slot_keys == key[todo][:, None]
            if same.any():
                same[same] = self._check[win[same]] == np.repeat(check[todo], same.sum(1))
            ends = same | (slot_keys == 0)
            ended = ends.any(1)
            t = np.arange(len(todo))
            first_end = ends.argmax(1)
            at = win[t, first_end]  # [T] the slot that ends each probe (where `ended`)
            hit = ended & same[t, first_end]
            found[todo[hit]] = self._rows[at[hit]]
            empty = np.flatnonzero(ended & ~hit)
            # ids ending at the same empty slot: the first takes it, the others probe on from it
            # NOTE: return_index gives each slot's first occurrence (a stable sort)
            slots, first = np.unique(at[empty], return_index=True)
            winners = todo[empty[first]]
            self._keys[slots] = key[winners]
            self._check[slots] = check[winners]
            self._rows[slots] = rows[winners]
            self._count += len(winners)
            done = hit
            done[empty[first]] = True
            lost = ended & ~done
            pos[todo[lost]] = at[lost]
            pos[todo[~ended]] += width
            todo = todo[~done]
            width = min(2 * width, len(_WINDOW))
        return found

    def _grow(self, needed: int) -> None:
        capacity = self.capacity
        while needed * 4 > capacity * 3:
            capacity *= 2
        old_keys, old_check, old_rows = self._keys, self._check, self._rows
        self._alloc(capacity, old_rows.dtype.type)
        self._count = 0
        for start in range(0, len(old_keys), _REHASH_CHUNK):
            part = slice(start, start + _REHASH_CHUNK)
            used = np.flatnonzero(old_keys[part])
            if len(used):
                self._place(
                    old_keys[part][used],
                    old_check[part][used],
                    old_rows[part][used].astype(np.int64),
                )
