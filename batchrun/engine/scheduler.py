"""Continuous batching: which requests run this step, and how many tokens each.

Every step builds one batch: each decoding request contributes its one pending token, then
partially prefilled requests continue and waiting requests are admitted while the prefill token
budget (chunked prefill) and the KV budget last. When the pool runs dry for decodes, the request
with the least progress is retracted: its KV goes to the radix cache (or is freed) and it waits
again at the front of the queue, to resume with its output so far as part of its prompt.

Admission takes the queue in the order given (`batchrun submit` feeds it in prefix DFS order,
batchrun/job/order.py), lets the longest cached prefix among the first few go first, and locks the
cached prefixes of the next few between steps so that decode growth evicts other leaves first.

A hybrid model (kv.snapshots) gets its snapshot boundaries at admission, from the prompts of the
next waiting requests (state_snapshots.boundaries); its prefill chunks end there, so that each
boundary's state can be saved. A retracted hybrid request keeps its state as a snapshot.
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import NamedTuple

import torch

from batchrun.engine.kv_manager import KVManager
from batchrun.engine.request import PLACEHOLDER, Req
from batchrun.engine.state_snapshots import SNAPSHOT_LOOKAHEAD, boundaries, common_prefix_len

# a waiting request is held back while a running prefill shares at least this many of its
# uncached tokens: that prefix is computed once and then served from the cache
MIN_SHARED_PREFIX = 16
# admission looks this far into the queue for requests whose prefix is cached (bounded work)
CACHE_AWARE_WINDOW = 16
# between steps, the cached prefixes of this many waiting requests are locked against eviction
PIN_HEADS = 4


class ScheduledBatch(NamedTuple):
    reqs: tuple[Req, ...]
    extend_lens: tuple[int, ...]  # new tokens per request
    prefix_lens: tuple[int, ...]  # kv_len before this step
    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    out_cache_loc: torch.Tensor  # [T] int64, CPU
    sample_mask: tuple[bool, ...]  # which requests produce a token this step

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(p + n for p, n in zip(self.prefix_lens, self.extend_lens, strict=True))


class Scheduler:
    def __init__(
        self,
        kv: KVManager,
        max_running: int,
        chunked_prefill_size: int | None,
        init_new_token_ratio: float,
    ):
        self.kv = kv
        self.max_running = max_running
        self.prefill_budget = chunked_prefill_size or 1 << 62
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.init_new_token_ratio = init_new_token_ratio
        self.new_token_ratio = init_new_token_ratio
        self.num_retractions = 0
        self.num_held = 0  # admissions deferred to share a prefix being computed
        # prompt tokens of requests at their first admission (a retracted request readmitted is
        # not counted again), and how many of them the prefix cache served
        self.num_admitted_tokens = 0
        self.num_admitted_cached_tokens = 0
        self._aborted: list[Req] = []
        self._pins: list = []  # radix nodes locked for the head of the queue (_pin_heads)
        # set when only a request with tokens in flight could make room: the engine must
        # process the in-flight step, then schedule again
        self.needs_sync = False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        self.needs_sync = False
        decoding, prefilling = self._classify()
        num_running = len(self.running)
        decodes = self._schedule_decodes(decoding)
        if self.needs_sync:
            return None
        if len(self.running) != num_running:  # retractions or aborts (rare)
            prefilling = self._classify()[1]
        chunks: list[tuple[Req, int]] = []
        budget = self._continue_prefills(chunks, self.prefill_budget, prefilling)
        if not decodes and not chunks and prefilling:
            # only partial prefills run and the first cannot get its next chunk: without this
            # the engine would spin forever
            self._unblock_prefills(prefilling[0])
            if self.needs_sync:
                return None
            prefilling = self._classify()[1]
            budget = self._continue_prefills(chunks, budget, prefilling)
        self._admit(chunks, budget, prefilling)
        if not decodes and not chunks:
            return None
        return self._build(decodes, chunks)

    def _classify(self) -> tuple[list[Req], list[Req]]:
        """The running requests that want a decode step, and those still prefilling, in running
        order. One pass, with Req.wants_decode / Req.is_decoding inlined: this runs for every
        request every step (running requests always hold a row)."""
        decoding: list[Req] = []
        prefilling: list[Req] = []
        for r in self.running:
            num_out = len(r.output_ids)
            if num_out and r.kv_len + 1 == len(r.input_ids) + num_out:
                if num_out < r.params.max_new_tokens:
                    decoding.append(r)
            else:
                prefilling.append(r)
        return decoding, prefilling

    def _schedule_decodes(self, decoding: list[Req]) -> list[Req]:
        """Reserve a slot for each decode; returns the requests that got one (in order)."""
        # the common case: one allocation for all (if the pool is short, the queue's pinned
        # prefixes give way before anything is retracted)
        if self.kv.reserve_decodes(decoding) or (
            self._unpin() and self.kv.reserve_decodes(decoding)
        ):
            return decoding
        decodes: list[Req] = []
        i = 0
        while i < len(decoding):
            req = decoding[i]
            if self.kv.reserve(req, 1) is not None:
                decodes.append(req)
                i += 1
                continue
            victim = self._pick_victim(exclude=req)
            if victim is None and self._any_inflight():
                self.needs_sync = True
                return decodes
            if victim is None:
                self._abort(
                    req,
                    "the KV pool cannot hold this request alone; raise --kv-budget or lower "
                    "max_tokens",
                )
                decoding.pop(i)
                continue
            self._retract(victim)
            if victim in decoding:
                idx = decoding.index(victim)
                decoding.pop(idx)
                if idx < i:  # it had a slot already: drop it from the plan
                    decodes.remove(victim)
                    i -= 1
        return decodes

    def _continue_prefills(
        self, chunks: list[tuple[Req, int]], budget: int, prefilling: list[Req]
    ) -> int:
        """Next chunks of partially prefilled requests, in admission order; returns the budget
        left."""
        for req in prefilling:
            if budget <= 0:
                break
            if req.num_inflight:
                continue
            n = self._chunk(req, min(len(req.input_ids) + len(req.output_ids) - req.kv_len, budget))
            if self.kv.reserve(req, n) is None and not (
                self._unpin() and self.kv.reserve(req, n) is not None
            ):
                break
            chunks.append((req, n))
            budget -= n
        return budget

    def _unblock_prefills(self, stuck: Req) -> None:
        """Partial prefills fill the pool: retract one so that the oldest (`stuck`) can go on;
        alone, the oldest cannot fit the pool at all and is aborted."""
        victim = self._pick_victim(exclude=stuck)
        if victim is not None:
            self._retract(victim)
            return
        if self._any_inflight():
            self.needs_sync = True
            return
        self._abort(
            stuck,
            f"needs {stuck.seq_len} KV slots at once but the pool holds "
            f"{self.kv.allocator.capacity}; raise --kv-budget",
        )

    @staticmethod
    def _chunk(req: Req, n: int) -> int:
        """`n` tokens of `req`'s prefill, cut at its next snapshot boundary."""
        at = req.snapshot_at
        return min(n, at[0] - req.kv_len) if at and at[0] > req.kv_len else n

    def _abort(self, req: Req, error: str) -> None:
        req.finish_reason, req.error = "abort", error
        self.running.remove(req)
        self.kv.release(req)
        self._aborted.append(req)

    def drain_aborted(self) -> list[Req]:
        aborted, self._aborted = self._aborted, []
        return aborted

    def _any_inflight(self) -> bool:
        return any(r.num_inflight for r in self.running)

    def _pick_victim(self, exclude: Req) -> Req | None:
        # a request with tokens in flight cannot be retracted: its KV and ids are not final
        candidates = [r for r in self.running if r is not exclude and not r.num_inflight]
        if not candidates:
            return None
        # least progress first: fewest outputs, then the longest prompt (frees the most)
        return min(candidates, key=lambda r: (len(r.output_ids), -len(r.input_ids), -r.arrival))

    def _retract(self, req: Req) -> None:
        self.running.remove(req)
        self.kv.release(req, keep_state=True)
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)
        # decode growth outran the reservation: reserve more for a while
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)

    def _reserved(self) -> int:
        """Slots the running requests are expected to still need: per request its pending tokens,
        new_token_ratio of its remaining max_new_tokens, and a page (properties inlined)."""
        ratio = self.new_token_ratio
        total = self.kv.page_size * len(self.running)
        for r in self.running:
            num_out = len(r.output_ids)
            total += len(r.input_ids) + num_out - r.kv_len
            total += int((r.params.max_new_tokens - num_out) * ratio)
        return total

    def _admit(self, chunks: list[tuple[Req, int]], budget: int, prefilling: list[Req]) -> None:
        """Admit waiting requests while budget, rows and KV last; `prefilling`: the running
        requests not decoding."""
        # admission locks what it takes itself; the heads' pins have done their job
        self._unpin()
        if not self.waiting:
            return
        if budget <= 0 or len(self.running) >= self.max_running:
            self._pin_heads()  # nothing can be admitted this step
            return
        self._prefer_cached()
        headroom = self.kv.available - self._reserved()
        # the running requests not decoding; kept up to date as requests are admitted (nothing
        # else changes while admitting)
        prefill = list(prefilling)
        held: list[Req] = []
        scanned = 0
        window = 2 * self.max_running
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            if scanned >= window:
                break
            req = self.waiting.popleft()
            scanned += 1
            if prefill and self._shares_uncached_prefix(req, prefill):
                held.append(req)
                continue
            match = self.kv.match(req)
            need = req.seq_len - match.length + int(req.max_new_remaining * self.new_token_ratio)
            if need > headroom and self.running:
                self.waiting.appendleft(req)
                break
            first = req.cached_tokens is None
            if not self.kv.admit(req, match):
                self.waiting.appendleft(req)
                break
            if first:
                self.num_admitted_tokens += len(req.input_ids)
                self.num_admitted_cached_tokens += req.cached_tokens
            if self.kv.snapshots is not None:
                followers = (w.input_ids for w in islice(self.waiting, SNAPSHOT_LOOKAHEAD))
                req.snapshot_at = boundaries(
                    req.input_ids, req.kv_len, followers, self.kv.page_size
                )
            n = self._chunk(req, min(req.num_pending, budget))
            if self.kv.reserve(req, n) is None:
                self.kv.release(req)
                self.waiting.appendleft(req)
                break
            self.running.append(req)
            if not req.is_decoding:
                prefill.append(req)
            chunks.append((req, n))
            budget -= n
            headroom -= need
        self.num_held += len(held)
        self.waiting.extendleft(reversed(held))
        if not self.waiting:
            self.new_token_ratio = max(0.1, self.new_token_ratio - 0.001)
        self._pin_heads()

    # -- prefix-aware admission (the queue arrives in batchrun.job.order's DFS order) --------------

    def _prefer_cached(self) -> None:
        """Among the first CACHE_AWARE_WINDOW waiting requests, the longest cached prefix goes
        first (stable: the given order breaks ties). Catches what a retraction or an ordering
        window's edge put apart, at a bounded cost per step."""
        if not self.kv.cache_enabled or len(self.waiting) < 2:
            return
        head = [self.waiting.popleft() for _ in range(min(CACHE_AWARE_WINDOW, len(self.waiting)))]
        cached = [self.kv.match(r).length for r in head]
        order = sorted(range(len(head)), key=lambda i: -cached[i])
        self.waiting.extendleft(head[i] for i in reversed(order))

    def _pin_heads(self) -> None:
        """Lock the cached prefix of the next PIN_HEADS waiting requests until the next admission,
        so that the next step's decodes and prefills evict other leaves first.

        NOTE: pins never cost a retraction or an abort: an allocation that fails releases them
        (`_unpin`) and is retried. Only taken while requests run (an idle engine evicts nothing,
        and so no pin outlives the queue: the engine stops once nothing runs or waits)."""
        if not self.running or not self.kv.cache_enabled:
            return
        for req in islice(self.waiting, PIN_HEADS):
            match = self.kv.match(req)
            if match.length:
                self.kv.cache.lock(match.last_node)
                self._pins.append(match.last_node)

    def _unpin(self) -> bool:
        """Release the pins; True if there were any."""
        for node in self._pins:
            self.kv.cache.unlock(node)
        had, self._pins = bool(self._pins), []
        return had

    def _shares_uncached_prefix(self, req: Req, prefilling: list[Req]) -> bool:
        ids = req.input_ids
        cached = None
        for other in prefilling:
            if other.input_ids[:1] != ids[:1]:
                continue
            shared = common_prefix_len(ids, other.input_ids)
            if shared < MIN_SHARED_PREFIX:
                continue
            if cached is None:
                cached = self.kv.match_len(ids)
            if shared - cached >= MIN_SHARED_PREFIX:
                return True
        return False

    def _build(self, decodes: list[Req], chunks: list[tuple[Req, int]]) -> ScheduledBatch:
        """The batch: `decodes` (one token each, the newest) first, then the prefill `chunks`."""
        kv = self.kv
        num_decodes = len(decodes)
        prefix_lens = [r.kv_len for r in decodes]
        # a decode's one pending token is its newest: kv_len + 1 == seq_len, outputs non-empty
        input_ids = [r.output_ids[-1] for r in decodes]
        positions = prefix_lens.copy()
        extend_lens = [1] * num_decodes
        sample_mask = [True] * num_decodes
        locs = [kv.slots_at([r.row for r in decodes], prefix_lens)] if decodes else []
        table = kv.table_cpu
        for req, n in chunks:
            start = req.kv_len
            end = start + n
            prefix_lens.append(start)
            extend_lens.append(n)
            input_ids.extend(req.tokens(start, end))
            positions.extend(range(start, end))
            locs.append(table[req.row, start:end])
            sample_mask.append(end == len(req.input_ids) + len(req.output_ids))
        reqs = tuple(decodes) + tuple([r for r, _ in chunks]) if chunks else tuple(decodes)
        # NOTE: a copy, never a view of table_cpu (later writes must not change a built batch)
        out_cache_loc = locs[0] if not chunks else torch.cat(locs)
        return ScheduledBatch(
            reqs=reqs,
            extend_lens=tuple(extend_lens),
            prefix_lens=tuple(prefix_lens),
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            sample_mask=tuple(sample_mask),
        )

    # -- after the step -----------------------------------------------------------------------

    def advance(self, batch: ScheduledBatch) -> None:
        """The step is launched: its KV counts as computed (the device runs in stream order),
        each sampling request gets a placeholder for its new token, and finished prefills are
        shared with the tree."""
        kv = self.kv
        for req, n, sampled in zip(batch.reqs, batch.extend_lens, batch.sample_mask):
            out = req.output_ids
            req.kv_len += n
            if n > 1 or not out:  # a prefill chunk
                kv.cache_unfinished(req)
            if sampled:
                out.append(PLACEHOLDER)
                req.num_inflight += 1

    def finish(self, req: Req) -> None:
        self.running.remove(req)
        self.kv.release(req)
