"""batchrun.job.order: DFS order over token ids, windows, reuse figures, splits that keep prefix
groups together, and (slow) the 1,000,000-prompt time and memory budget."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from batchrun.job.order import (
    LRUEstimate,
    common_prefix_len,
    dfs_order,
    order_items,
    ordered_windows,
    packed_keys,
    predicted_reuse,
    prefix_group_key,
    reuse_lens,
    shard_of,
    sort_key,
    split_ranges,
)

ROOT = Path(__file__).resolve().parents[2]


def grouped_prompts(
    seed: int, groups: int = 20, per_group: int = 6, prefix_len: int = 40
) -> list[list[int]]:
    """Shuffled prompts: groups sharing a prefix (some nested), a few duplicates and a few
    prompts that are a prefix of another; ids up to 2**31 to exercise the byte order."""
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        prefix = [rng.randrange(0, 2**31) for _ in range(rng.randrange(1, prefix_len))]
        sub = prefix + [rng.randrange(0, 300) for _ in range(5)]
        for _ in range(per_group):
            base = sub if rng.random() < 0.3 else prefix
            out.append(base + [rng.randrange(0, 300) for _ in range(rng.randrange(0, 10))])
        out.append(list(prefix))  # a prefix of its siblings
    out += [list(out[3]), list(out[7])]  # duplicates
    rng.shuffle(out)
    return out


def trie_dfs(prompts: list[list[int]]) -> list[list[int]]:
    """Reference: build a dict trie, walk it depth first (children by ascending token)."""
    root: dict = {}
    for i, p in enumerate(prompts):
        node = root
        for t in p:
            node = node.setdefault(t, {})
        node.setdefault(None, []).append(i)
    out: list[list[int]] = []

    def walk(node: dict) -> None:
        out.extend(prompts[i] for i in node.get(None, []))
        for t in sorted(k for k in node if k is not None):
            walk(node[t])

    walk(root)
    return out


def test_sort_key_compares_like_the_ids() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        a = [rng.choice([0, 1, 255, 256, 70000, 2**32 - 1]) for _ in range(rng.randrange(4))]
        b = [rng.choice([0, 1, 255, 256, 70000, 2**32 - 1]) for _ in range(rng.randrange(4))]
        assert (sort_key(a) < sort_key(b)) == (a < b)
        assert sort_key(np.array(a, dtype=np.int64)) == sort_key(a)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dfs_order_is_the_trie_walk_and_groups_are_contiguous(seed: int) -> None:
    prompts = grouped_prompts(seed)
    ordered = order_items(prompts, lambda p: p)
    assert ordered == trie_dfs(prompts)
    # every prefix of every prompt is shared by a contiguous run of the order
    for p in prompts[:40]:
        for depth in (1, len(p) // 2, len(p)):
            hits = [i for i, q in enumerate(ordered) if q[:depth] == p[:depth]]
            assert hits == list(range(hits[0], hits[-1] + 1))


def test_equal_prompts_keep_input_order() -> None:
    items = [("a", [5, 6]), ("b", [1]), ("c", [5, 6]), ("d", [5, 6])]
    assert [n for n, _ in order_items(items, lambda x: x[1])] == ["b", "a", "c", "d"]


def test_packed_keys_match_per_prompt_keys() -> None:
    prompts = grouped_prompts(3)
    lens = [len(p) for p in prompts]
    offsets = np.zeros(len(prompts) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    tokens = np.array([t for p in prompts for t in p], dtype=np.uint32)
    keys = packed_keys(tokens, offsets, chunk=7)
    assert keys == [sort_key(p) for p in prompts]
    assert [prompts[i] for i in dfs_order(keys)] == trie_dfs(prompts)


def test_windows_order_each_window_and_keep_every_item() -> None:
    prompts = grouped_prompts(4)
    items = list(enumerate(prompts))
    out = list(ordered_windows(iter(items), lambda x: x[1], window=25))
    assert sorted(i for i, _ in out) == list(range(len(items)))
    for start in range(0, len(items), 25):
        window = out[start : start + 25]
        assert {i for i, _ in window} == set(range(start, min(start + 25, len(items))))
        assert [p for _, p in window] == sorted(p for _, p in window)
    assert list(ordered_windows([], lambda x: x, 3)) == []
    with pytest.raises(ValueError):
        list(ordered_windows(items, lambda x: x[1], 0))


def test_common_prefix_and_reuse_lens_count_the_trie() -> None:
    assert common_prefix_len(sort_key([1, 2, 3]), sort_key([1, 2, 4])) == 2
    assert common_prefix_len(sort_key([1, 2]), sort_key([1, 2, 4])) == 2
    assert common_prefix_len(sort_key([9]), sort_key([1])) == 0
    prompts = grouped_prompts(5)
    keys = sorted(sort_key(p) for p in prompts)
    reuse = reuse_lens(keys)
    # an unlimited cache computes each trie node once, except that the engine always computes a
    # prompt's last token: reused = tokens - nodes - (prompts whose last token is a cached node)
    nodes = {tuple(p[:i]) for p in prompts for i in range(1, len(p) + 1)}
    first_seen: set = set()
    recompute = 0
    for p in trie_dfs(prompts):  # a prompt ending on an already-seen node recomputes 1 token
        recompute += tuple(p) in first_seen
        first_seen.update(tuple(p[:i]) for i in range(1, len(p) + 1))
    total = sum(len(p) for p in prompts)
    assert int(reuse.sum()) == total - len(nodes) - recompute
    assert reuse[0] == 0 and all(r <= len(k) // 4 - 1 for r, k in zip(reuse, keys))


def test_lru_estimate_prefix_order_beats_input_order() -> None:
    rng = random.Random(0)
    prompts = []
    for _ in range(30):
        prefix = [rng.randrange(3, 1000) for _ in range(96)]
        prompts += [prefix + [rng.randrange(3, 1000) for _ in range(10)] for _ in range(5)]
    rng.shuffle(prompts)
    keys = [sort_key(p) for p in prompts]
    dfs = dfs_order(keys)
    reuse = reuse_lens([keys[i] for i in dfs])
    block_unlimited = int((reuse // 16 * 16).sum())

    def simulate(capacity: int, order) -> float:
        sim = LRUEstimate(capacity)
        for i in order:
            sim.feed(keys[i], 8)
        return predicted_reuse(int(reuse.sum()), sim.hits, block_unlimited)

    unlimited = simulate(10**9, range(len(keys)))
    assert unlimited == pytest.approx(reuse.sum())
    assert simulate(10**9, dfs) == pytest.approx(reuse.sum())
    in_dfs, in_input = simulate(400, dfs), simulate(400, range(len(keys)))
    assert in_dfs >= 0.95 * unlimited
    assert in_input <= 0.3 * unlimited


def test_splits_keep_prefix_groups_together() -> None:
    rng = random.Random(1)
    prompts, group_of = [], []
    for g in range(40):
        prefix = [rng.randrange(3, 5000) for _ in range(70)]
        for _ in range(rng.randrange(1, 30)):
            prompts.append(prefix + [rng.randrange(3, 5000) for _ in range(rng.randrange(1, 9))])
            group_of.append(g)
    keys = [sort_key(p) for p in prompts]
    dfs = dfs_order(keys)
    sorted_keys = [keys[i] for i in dfs]
    for num_shards in (1, 3, 8):
        ranges = split_ranges(sorted_keys, num_shards, depth=64)
        assert len(ranges) == num_shards
        assert ranges[0][0] == 0 and ranges[-1][1] == len(prompts)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        shard_of_group: dict[int, int] = {}
        for s, (start, end) in enumerate(ranges):
            for i in dfs[start:end]:
                assert shard_of_group.setdefault(group_of[i], s) == s
        sizes = [end - start for start, end in ranges]
        assert max(sizes) <= len(prompts) / num_shards + 30  # balanced up to one group
    # hash split: stable across processes, one shard per group
    for num_shards in (2, 5):
        by_group: dict[int, set[int]] = {}
        for p, g in zip(prompts, group_of):
            by_group.setdefault(g, set()).add(shard_of(p, num_shards, depth=64))
        assert all(len(s) == 1 for s in by_group.values())
        assert len(set().union(*by_group.values())) == num_shards
    code = "from batchrun.job.order import prefix_group_key; print(prefix_group_key([1, 2, 3]))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert int(other.stdout) == prefix_group_key([1, 2, 3])  # no per-process hash salt


@pytest.mark.slow
def test_order_one_million_prompts_within_budget() -> None:
    """1,000,000 prompts of ~300 tokens: keys + DFS order within 60 s and 4 GiB (input
    included). On the 2-core CPU machine `python scripts/bench_order.py` measures 6.5-8.0 s and
    2.46 GiB peak RSS; the reusable-prefix pass takes about 4 s more."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts/bench_order.py"), "--num", "1000000", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["num_prompts"] == 1_000_000
    assert 280 <= result["mean_len"] <= 320
    assert result["order_s"] < 60, result
    assert result["peak_rss_gib"] < 4.0, result
    assert result["reuse_s"] < 60, result
