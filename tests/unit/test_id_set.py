"""IdSet against a dict: first rows of repeated ids, within and across batches, growth."""

from __future__ import annotations

import hashlib
import random

import numpy as np

from batchrun.io.id_set import IdSet, hash_ids


def reference(batches: list[list[tuple[str, int]]]) -> list[list[int]]:
    seen: dict[str, int] = {}
    out = []
    for batch in batches:
        firsts = []
        for ident, row in batch:
            firsts.append(seen.get(ident, -1))
            seen.setdefault(ident, row)
        out.append(firsts)
    return out


def test_first_rows_match_a_dict_through_growth() -> None:
    rng = random.Random(0)
    row = 0
    batches = []
    for _ in range(60):
        batch = []
        for _ in range(rng.choice([1, 7, 256, 1000])):
            # a small pool of ids, so repeats land within a batch and across batches
            batch.append((f"id-{rng.randrange(20_000)}", row))
            row += rng.choice([1, 1, 2])  # blank lines: row numbers with gaps
        batches.append(batch)
    ids = IdSet(capacity=16)
    got = [ids.add([i for i, _ in b], [r for _, r in b]).tolist() for b in batches]
    assert got == reference(batches)
    distinct = len({i for b in batches for i, _ in b})
    assert len(ids) == distinct and ids.capacity * 3 >= distinct * 4  # at most 3/4 full
    assert ids.nbytes == ids.capacity * 16


def test_colliding_slots_and_keys_differing_only_in_check() -> None:
    ids = IdSet(capacity=16)
    key = np.array([5, 5 + 16, 5 + 32, 5, 5 + 16], dtype=np.uint64)  # one home slot
    check = np.array([1, 1, 1, 2, 1], dtype=np.uint32)  # ids 0 and 3 differ in the check only
    got = ids.add_hashed(key, check, np.arange(10, 15, dtype=np.int64))
    assert got.tolist() == [-1, -1, -1, -1, 11]
    assert ids.add_hashed(key[::-1], check[::-1], np.arange(5, dtype=np.int64)).tolist() == [
        11,
        13,
        12,
        11,
        10,
    ]


def test_rows_past_uint32_widen() -> None:
    ids = IdSet()
    big = (1 << 32) + 7
    assert ids.add(["a", "b"], [3, big]).tolist() == [-1, -1]
    assert ids.add(["b", "a", "c"], [big + 1, big + 2, big + 3]).tolist() == [big, 3, -1]


def test_hash_is_stable_and_never_zero() -> None:
    key, check = hash_ids(["g1", "g1", "g2", "\ud800"])
    assert key[0] == key[1] and check[0] == check[1] and key[0] != key[2]
    assert (key != 0).all() and key.dtype == np.uint64 and check.dtype == np.uint32
    # the same digest in every process: a fixed value
    digest = hashlib.blake2b(b"g1", digest_size=16).digest()
    assert int(hash_ids(["g1"])[0][0]) == int.from_bytes(digest[:8], "little")
