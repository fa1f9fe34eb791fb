"""A packed causal step whose sequences share prefixes computes each shared prefix once.

Consecutive sequences of a step that begin with the same tokens (a rerank row's documents behind
their instruction + query; rows behind one instruction) form a tree of segments: a segment is a
run of tokens computed once, and its tokens attend to the keys of its ancestors and to its own
tokens causally. Every token sees exactly the keys it sees unshared, so its hidden state is the
unshared one; only the tokens of the shared prefixes are not repeated.

    sequence 0:  [ instruction | query A | doc 0 ]      segments:  0 instruction   (root)
    sequence 1:  [ instruction | query A | doc 1 ]                 1 query A       (parent 0)
    sequence 2:  [ instruction | query B | doc 0 ]                 2 doc 0         (parent 1)
                                                                   3 doc 1         (parent 1)
                                                                   4 query B, doc 0 (parent 0)

The packed step holds the segments' tokens in segment order; `kv_rows` lists, segment by
segment, the packed rows of the keys it attends (its ancestors' rows root first, then its own),
which are its positions 0 .. end - 1. Only causal models whose result reads a sequence's last
token (last-token pooling, a classification head, a yes/no reranker) share: bidirectional
encoders cannot (a prefix token attends to the document after it), and mean pooling reads every
token of every sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# a shared prefix shorter than this runs again with each sequence: a split into more segments
# costs a gather of their keys in every layer for little computed once
MIN_SHARED_TOKENS = 8


@dataclass(frozen=True)
class PrefixPlan:
    input_ids: tuple[int, ...]  # [T] the segments' tokens, packed in segment order
    positions: tuple[int, ...]  # [T] each token's position in its sequences
    seg_lens: tuple[int, ...]  # tokens each segment computes
    kv_lens: tuple[int, ...]  # keys each segment attends (its end position)
    kv_rows: tuple[int, ...] | None  # packed rows of those keys per segment; None: no sharing
    last_rows: tuple[int, ...]  # [B] the packed row of each sequence's last token
    num_shared: tuple[int, ...]  # [B] tokens of each sequence read from a shared prefix

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def _common_len(a: tuple[int, ...], b: tuple[int, ...], limit: int) -> int:
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def shared_len(prev: tuple[int, ...] | None, ids: tuple[int, ...], min_shared: int) -> int:
    """The tokens of `ids` that the sequence before it in a step computes for it: their common
    prefix, short of the last token (each sequence computes its own last token), if at least
    `min_shared` long."""
    if prev is None:
        return 0
    n = _common_len(prev, ids, min(len(prev), len(ids) - 1))
    return n if n >= min_shared else 0


def plan_shared_prefixes(
    seqs: list[tuple[int, ...]], share: bool = True, min_shared: int = MIN_SHARED_TOKENS
) -> PrefixPlan:
    """The segments of `seqs` (each non-empty), sharing what consecutive sequences share (with
    `share` False: one segment per sequence)."""
    segs: list[list[int]] = []  # [parent, owner sequence, start, end]
    leaf: list[int] = []  # per sequence: the segment that holds its last token
    path: list[int] = []  # the previous sequence's segments, root first
    num_shared: list[int] = []
    for i, ids in enumerate(seqs):
        n = shared_len(seqs[i - 1] if i and share else None, ids, min_shared)
        while path and segs[path[-1]][2] >= n:
            path.pop()
        if path and segs[path[-1]][3] > n:  # n falls inside a segment: split it there
            s, tail = path[-1], len(segs)
            for seg in segs:  # what hung below s hangs below its tail
                if seg[0] == s:
                    seg[0] = tail
            segs.append([s, segs[s][1], n, segs[s][3]])
            segs[s][3] = n
            leaf = [tail if x == s else x for x in leaf]
        path.append(len(segs))
        leaf.append(len(segs))
        segs.append([path[-2] if len(path) > 1 else -1, i, n, len(ids)])
        num_shared.append(n)
    offsets, input_ids, positions, total = [], [], [], 0
    for _, owner, start, end in segs:
        offsets.append(total)
        input_ids += seqs[owner][start:end]
        positions += range(start, end)
        total += end - start
    kv_rows = None
    if any(seg[0] >= 0 for seg in segs):
        rows: list[int] = []
        for s in range(len(segs)):
            chain = [s]
            while segs[chain[-1]][0] >= 0:
                chain.append(segs[chain[-1]][0])
            for a in reversed(chain):
                rows += range(offsets[a], offsets[a] + segs[a][3] - segs[a][2])
        kv_rows = tuple(rows)
    last_rows = tuple(
        offsets[leaf[i]] + len(ids) - 1 - segs[leaf[i]][2] for i, ids in enumerate(seqs)
    )
    return PrefixPlan(
        tuple(input_ids),
        tuple(positions),
        tuple(end - start for _, _, start, end in segs),
        tuple(end for *_, end in segs),
        kv_rows,
        last_rows,
        tuple(num_shared),
    )


def prefix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: PrefixPlan,
    kv_rows: torch.Tensor,
    scaling: float,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of each segment's queries q [T, H, D] over its ancestors' and its own
    keys (k, v [T, KV, D]; `kv_rows` is plan.kv_rows on q's device) -> [T, H * D]. `window` > 0:
    the query at p sees the keys p - window < k <= p."""
    k, v = k.index_select(0, kv_rows), v.index_select(0, kv_rows)
    if k.shape[1] != q.shape[1]:  # GQA: each KV head serves a group of query heads
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return _flash(q, k, v, plan, scaling, window)
    out = torch.empty_like(q)
    q_start = k_start = 0
    for n, kv_len in zip(plan.seg_lens, plan.kv_lens, strict=True):
        qs = q[q_start : q_start + n].transpose(0, 1)  # [H, n, D]
        ks = k[k_start : k_start + kv_len].transpose(0, 1)  # [H, kv_len, D]
        vs = v[k_start : k_start + kv_len].transpose(0, 1)
        q_pos = torch.arange(kv_len - n, kv_len, device=q.device)
        dist = q_pos[:, None] - torch.arange(kv_len, device=q.device)[None, :]  # [n, kv_len]
        mask = (dist >= 0) & (dist < window) if window else dist >= 0
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scaling)
        out[q_start : q_start + n] = o.transpose(0, 1)
        q_start += n
        k_start += kv_len
    return out.reshape(q.shape[0], -1)


def _flash(q, k, v, plan: PrefixPlan, scaling: float, window: int) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    # NOTE: FlashAttention aligns a causal mask (and its window) bottom-right when a sequence has
    # fewer queries than keys: a segment's queries are the last seg_len of its kv_len positions
    cu_q = torch.tensor((0, *plan.seg_lens), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor((0, *plan.kv_lens), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_q = cu_q.pin_memory().to(q.device, non_blocking=True)
    cu_k = cu_k.pin_memory().to(q.device, non_blocking=True)
    bounds = (window - 1 if window else -1, 0)
    out = varlen_attn(q, k, v, cu_q, cu_k, max(plan.seg_lens), max(plan.kv_lens), scale=scaling,
                      window_size=bounds)  # fmt: skip
    return out.reshape(q.shape[0], -1)
