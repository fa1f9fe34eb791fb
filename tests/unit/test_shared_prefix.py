"""The shared-prefix plan of a packed causal step: every sequence's tokens are its own, each
shared prefix is computed once, and attention over the segments equals each sequence's own
causal attention (windows included)."""

from __future__ import annotations

import random

import pytest
import torch

from batchrun.pooling.shared_prefix import plan_shared_prefixes, prefix_attention
from batchrun.pooling.varlen import varlen_attention

INSTR = tuple(range(100, 120))


def _rerank_seqs(rng: random.Random) -> list[tuple[int, ...]]:
    """Rows of (instruction, query, document): documents share their row's query."""
    seqs = []
    for _ in range(4):
        query = tuple(rng.randrange(50) for _ in range(rng.randrange(1, 15)))
        for _ in range(rng.randrange(1, 5)):
            doc = tuple(rng.randrange(50) for _ in range(rng.randrange(1, 9)))
            seqs.append(INSTR + query + doc)
    seqs.append(INSTR + seqs[-1][len(INSTR) :])  # a duplicate: still computes its last token
    seqs.append(INSTR[:5])  # a prefix of the instruction
    seqs.append(tuple(range(7)))  # nothing shared
    return seqs


def _tokens_of(plan, s):
    """The (token, position) pairs that segment s attends over, from its kv rows."""
    start = sum(plan.kv_lens[:s])
    rows = plan.kv_rows[start : start + plan.kv_lens[s]]
    return [plan.input_ids[r] for r in rows], [plan.positions[r] for r in rows]


@pytest.mark.parametrize("seed", range(5))
def test_each_sequence_reads_its_own_tokens_and_shared_prefixes_run_once(seed):
    seqs = _rerank_seqs(random.Random(seed))
    plan = plan_shared_prefixes(seqs, min_shared=4)
    assert plan.num_tokens == sum(map(len, seqs)) - sum(plan.num_shared)
    assert plan.num_shared[0] == 0 and plan.num_shared[1] >= len(INSTR)
    assert plan.num_shared[-1] == 0 and plan.num_shared[-2] == 4  # the 5-token prefix
    # the keys up to each sequence's last token are its tokens at positions 0 .. len - 1
    seg_starts = [0]
    for n in plan.seg_lens:
        seg_starts.append(seg_starts[-1] + n)
    for ids, last in zip(seqs, plan.last_rows, strict=True):
        s = max(i for i, start in enumerate(seg_starts[:-1]) if start <= last)
        tokens, positions = _tokens_of(plan, s)
        upto = plan.kv_lens[s] - (seg_starts[s + 1] - 1 - last)
        assert tokens[:upto] == list(ids) and positions[:upto] == list(range(len(ids)))
    unshared = plan_shared_prefixes(seqs, share=False)
    assert unshared.kv_rows is None and unshared.seg_lens == tuple(map(len, seqs))


@pytest.mark.parametrize("window", [0, 5])
def test_prefix_attention_equals_each_sequence_alone(window):
    torch.manual_seed(0)
    seqs = _rerank_seqs(random.Random(7))
    plan = plan_shared_prefixes(seqs, min_shared=4)
    # a token's q, k, v depend on (token, position) only, as in a model's first layer
    table = torch.randn(200, 300, 3, 4, 8, dtype=torch.float64)

    def qkv(ids, positions):
        t = table[torch.tensor(ids), torch.tensor(positions)]  # [T, 3, 4, 8]
        return t[:, 0], t[:, 1, :2], t[:, 2, :2]  # 4 query heads, 2 KV heads

    q, k, v = qkv(plan.input_ids, plan.positions)
    got = prefix_attention(q, k, v, plan, torch.tensor(plan.kv_rows), 0.3, window)
    flat = [t for s in seqs for t in s]
    q, k, v = qkv(flat, [p for s in seqs for p in range(len(s))])
    ref = varlen_attention(q, k, v, tuple(map(len, seqs)), 0.3, True, window=window)
    ends = torch.tensor([len(s) for s in seqs]).cumsum(0) - 1
    assert torch.allclose(got[torch.tensor(plan.last_rows)], ref[ends], atol=1e-12)
