"""Sampling on the device without host syncs.

Order (as in vLLM): raw logits -> logprobs of the raw distribution -> penalties -> min_new_tokens
mask -> greedy rows: argmax; sampled rows: / temperature -> top-k -> top-p -> min-p -> sample.
Rows with a grammar arrive with their disallowed tokens already at -inf (engine/grammar.py), so
logprobs, penalties and filters all see the constrained distribution.

Random draws come from a counter-based hash of (seed, step, token id), so a request draws the same
token whatever else is in the batch, on CPU and CUDA alike, and resumes identically after a
retraction (step = number of tokens generated so far). The draw is an exponential race /
Gumbel-max: argmax(logit / T - log(-log u)) over the allowed tokens, which samples
softmax(logit / T) restricted to that set without normalizing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import torch

from batchrun.config import KernelPlan
from batchrun.engine.penalties import PenaltyState, apply_penalties, to_device
from batchrun.engine.staging import PinnedStaging
from batchrun.params import SamplingParams

try:
    from batchrun.kernels.argmax import argmax
except ImportError:  # no Triton (CPU-only installs): KernelPlan.triton_ops is off
    argmax = None

_M32 = 0xFFFFFFFF
# murmur3 fmix32 constants, shifted into (-2**31, 0) so that x * c with x < 2**32 never leaves the
# int64 range; the low 32 bits are the same as for the unsigned product.
_C1 = 0x85EBCA6B - (1 << 32)
_C2 = 0xC2B2AE35 - (1 << 32)
_GOLDEN = 0x9E3779B9 - (1 << 32)
# NOTE: a disabled top-p is stored as 2.0, not 1.0: the fp32 cumsum can reach 1.0 before the last
# token, and "keep while exclusive cumsum < p" would then cut off the tail.
_TOP_P_OFF = 2.0


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3 finalizer on uint32 values held in int64 (a bijection with full avalanche)."""
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 13)
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[B] int64 seeds and steps -> [B] 32-bit keys, one per (seed, step)."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    key = _fmix32(lo ^ _fmix32(hi ^ 0x68E31DA4))
    return _fmix32(key ^ _fmix32((steps & _M32) ^ 0x1B56C4E9))


def uniforms(keys: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """[B] keys x [V] per-token hashes -> [B, V] fp32 uniforms in [2**-24, 1 - 2**-24]."""
    h = _fmix32(keys[:, None] ^ vocab_hash[None, :])
    # 23 random bits as an odd multiple of 2**-24: exact in fp32, never 0 or 1.
    return ((h >> 9) * 2 + 1).float() * (1.0 / (1 << 24))


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters on the device, built on the host once per step.

    The bool / int fields are computed on the host from the params, so branching on them costs no
    sync. Greedy rows get temperature 1, k = V, p off and min_p 0 so they never trigger the
    sampled path's work; their result is the argmax of the penalized logits. A batch of greedy
    rows without penalties reads no per-row column: its tensors (all but `banned`) are None.
    """

    temperatures: torch.Tensor  # [B] fp32; 1.0 for greedy rows
    top_ps: torch.Tensor  # [B] fp32; _TOP_P_OFF when disabled
    min_ps: torch.Tensor  # [B] fp32
    repetition_penalties: torch.Tensor  # [B] fp32
    frequency_penalties: torch.Tensor  # [B] fp32
    presence_penalties: torch.Tensor  # [B] fp32
    top_ks: torch.Tensor  # [B] int64; V when disabled
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64: tokens generated so far
    rows: torch.Tensor  # [B] int64: PenaltyState rows (req-pool indices)
    is_greedy: torch.Tensor  # [B] bool
    # [N] int64, batch index * V + token id: the EOS / stop ids masked (min_new_tokens)
    banned: torch.Tensor | None
    all_greedy: bool
    any_greedy: bool
    needs_sort: bool  # some sampled row has top-k or top-p
    needs_min_p: bool
    has_repetition: bool
    has_frequency_presence: bool
    needs_logprobs: bool
    num_top_logprobs: int  # K = max top_logprobs over the batch
    # [3, F] int64 (batch index, token, condition): sampled ids the device overrides
    # (the thinking budget's forced tokens; engine/thinking.py); None: none
    forced: torch.Tensor | None = None

    @property
    def has_penalties(self) -> bool:
        return self.has_repetition or self.has_frequency_presence

    @property
    def is_plain_greedy(self) -> bool:
        """Every row's token is the argmax of its logits as they come (no penalty, no banned
        id, no logprobs): a caller may take the argmax itself (a grammar's fused kernel)."""
        return (
            self.all_greedy
            and not self.has_penalties
            and not self.needs_logprobs
            and self.banned is None
        )

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        steps: list[int],
        rows: list[int],
        vocab_size: int,
        eos_token_ids: list[int],
        device: torch.device | str,
        staging: PinnedStaging | None = None,
    ) -> SamplingBatch:
        """Pack the batch into two H2D copies (floats, ints) plus one for masked ids, if any
        (through `staging`'s pinned ring when given: the engine's step path).

        vocab_size is the logits' last dimension. eos_token_ids are masked, together with the
        request's stop_token_ids, while steps[i] < params[i].min_new_tokens (not for rows with a
        grammar; their token bitmask is applied to the logits before the sampler).
        """
        device = torch.device(device)
        first = params[0] if params else None
        shared = first is not None and all(p is first for p in params)
        # NOTE: the usual batch (a job's rows share the defaults' params object): flags and
        # columns from that one object instead of per-row passes (host time on every step)
        distinct = [first] if shared else params
        sampled = [p for p in distinct if not p.is_greedy]
        flags = dict(
            all_greedy=not sampled,
            any_greedy=(not sampled) if shared else len(sampled) < len(params),
            needs_sort=any(0 < p.top_k < vocab_size or p.top_p < 1.0 for p in sampled),
            needs_min_p=any(p.min_p > 0.0 for p in sampled),
            has_repetition=any(p.repetition_penalty != 1.0 for p in distinct),
            has_frequency_presence=any(
                p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in distinct
            ),
            needs_logprobs=any(p.logprobs or p.top_logprobs > 0 for p in distinct),
            num_top_logprobs=max((p.top_logprobs for p in distinct), default=0),
        )
        plain = flags["all_greedy"] and not (
            flags["has_repetition"] or flags["has_frequency_presence"]
        )
        if shared and plain:
            floats = ints = None  # not needed (below)
            banned_rows, banned_ids = _banned_shared(first, steps, eos_token_ids)
        elif shared:
            floats, ints, banned_rows, banned_ids = _columns_shared(
                first, seeds, steps, rows, vocab_size, eos_token_ids
            )
        else:
            floats, ints, banned_rows, banned_ids = _columns(
                params, seeds, steps, rows, vocab_size, eos_token_ids
            )
        banned = None
        if banned_ids:
            # flat indices into the [B, V] logits, so that the device adds no index arithmetic
            flat = [r * vocab_size + t for r, t in zip(banned_rows, banned_ids, strict=True)]
            banned = (
                staging.to_device(flat, torch.int64)
                if staging is not None
                else to_device(flat, torch.int64, device)
            )
        if plain:
            # plain argmax reads none of the per-row columns: nothing else goes to the device
            return cls(*[None] * 11, banned=banned, **flags)
        if staging is not None:
            f = staging.to_device(list(chain.from_iterable(floats)), torch.float32).view(6, -1)
            n = staging.to_device(list(chain.from_iterable(ints)), torch.int64).view(5, -1)
        else:
            f = to_device(floats, torch.float32, device)  # [6, B]
            n = to_device(ints, torch.int64, device)  # [5, B]
        return cls(*f, *n[:4], n[4].bool(), banned=banned, **flags)


def _columns(params, seeds, steps, rows, vocab_size, eos_token_ids):
    """SamplingBatch.build's host columns, row by row: ([6][B] floats, [5][B] ints, banned)."""
    floats: list[list[float]] = [[] for _ in range(6)]
    ints: list[list[int]] = [[] for _ in range(5)]
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    for i, p in enumerate(params):
        greedy = p.is_greedy
        k = p.top_k if p.top_k > 0 and not greedy else vocab_size
        floats[0].append(1.0 if greedy else p.temperature)
        floats[1].append(p.top_p if p.top_p < 1.0 and not greedy else _TOP_P_OFF)
        floats[2].append(0.0 if greedy else p.min_p)
        floats[3].append(p.repetition_penalty)
        floats[4].append(p.frequency_penalty)
        floats[5].append(p.presence_penalty)
        ints[0].append(min(k, vocab_size))
        ints[1].append(_to_int64(seeds[i]))
        ints[2].append(steps[i])
        ints[3].append(rows[i])
        ints[4].append(int(greedy))
        # NOTE: a grammar decides where its output ends: banning EOS there could leave no
        # allowed token at all, so min_new_tokens does not apply to grammar rows
        if steps[i] < p.min_new_tokens and p.grammar is None:
            ids = dict.fromkeys([*eos_token_ids, *p.stop_token_ids])
            banned_rows.extend([i] * len(ids))
            banned_ids.extend(ids)
    return floats, ints, banned_rows, banned_ids


def _columns_shared(p: SamplingParams, seeds, steps, rows, vocab_size, eos_token_ids):
    """_columns for a batch whose rows all share one params object: the same columns."""
    n = len(steps)
    greedy = p.is_greedy
    k = p.top_k if p.top_k > 0 and not greedy else vocab_size
    floats = [
        [1.0 if greedy else p.temperature] * n,
        [p.top_p if p.top_p < 1.0 and not greedy else _TOP_P_OFF] * n,
        [0.0 if greedy else p.min_p] * n,
        [p.repetition_penalty] * n,
        [p.frequency_penalty] * n,
        [p.presence_penalty] * n,
    ]
    ints = [[min(k, vocab_size)] * n, [_to_int64(x) for x in seeds], list(steps), list(rows),
            [int(greedy)] * n]  # fmt: skip
    return (floats, ints, *_banned_shared(p, steps, eos_token_ids))


def _banned_shared(p: SamplingParams, steps, eos_token_ids) -> tuple[list[int], list[int]]:
    """(batch rows, token ids) masked by min_new_tokens, for rows that share params p."""
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    if p.min_new_tokens > 0 and p.grammar is None:
        ids = list(dict.fromkeys([*eos_token_ids, *p.stop_token_ids]))
        for i, step in enumerate(steps):
            if step < p.min_new_tokens:
                banned_rows.extend([i] * len(ids))
                banned_ids.extend(ids)
    return banned_rows, banned_ids


def _to_int64(seed: int) -> int:
    """Any Python int -> the signed int64 with the same low 64 bits."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


class SampleOutput(NamedTuple):
    next_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] fp32: raw log_softmax at the chosen token
    top_logprob_ids: torch.Tensor | None  # [B, K] int64, of the raw distribution
    top_logprob_vals: torch.Tensor | None  # [B, K] fp32


def greedy_ids(logits: torch.Tensor, kernels: KernelPlan | None = None) -> torch.Tensor:
    """logits.argmax(-1); with the Triton kernels kernels/argmax.py, which spreads each row over
    many programs where torch gives a row one block, a visible share of a batch-1 decode step
    (docs/benchmarks.md, "What each feature is worth": argmax kernel). The same ids: ties go to
    the lowest."""
    if kernels is not None and kernels.triton_ops and logits.dim() == 2:
        return argmax(logits, pdl=kernels.pdl)
    return logits.argmax(dim=-1)


class Sampler:
    """Stateless apart from a cache of the per-token hash for each (vocab size, device)."""

    def __init__(self, kernels: KernelPlan | None = None) -> None:
        self.kernels = kernels or KernelPlan.reference()
        self._vocab_hash: dict[tuple[int, torch.device], torch.Tensor] = {}

    def vocab_hash(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        key = (vocab_size, device)
        if key not in self._vocab_hash:
            ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
            self._vocab_hash[key] = _fmix32((ids * _GOLDEN) & _M32)  # [V]
        return self._vocab_hash[key]

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch, penalties: PenaltyState | None
    ) -> SampleOutput:
        if batch.is_plain_greedy:
            # the argmax of the logits as they come (bf16 on the GPU: the same ids as in fp32,
            # and half the bytes to read)
            return SampleOutput(greedy_ids(logits, self.kernels), None, None, None)
        if batch.all_greedy and not batch.has_penalties and not batch.needs_logprobs:
            # greedy rows with banned ids (min_new_tokens), the usual fixed-length batch job
            return SampleOutput(self._greedy_banned(logits, batch.banned), None, None, None)
        logits = logits.float()  # [B, V]; may alias the caller's tensor: no in-place edits
        num_rows, vocab_size = logits.shape

        logprobs = top_ids = top_vals = None
        if batch.needs_logprobs:
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
            if batch.num_top_logprobs > 0:
                top_vals, top_ids = torch.topk(raw_logprobs, batch.num_top_logprobs, dim=-1)

        if batch.has_penalties:
            if penalties is None:
                raise ValueError("the batch has penalties but no PenaltyState was given")
            logits = apply_penalties(
                logits,
                penalties,
                batch.rows,
                batch.repetition_penalties,
                batch.frequency_penalties,
                batch.presence_penalties,
                batch.has_repetition,
                batch.has_frequency_presence,
            )
        if batch.banned is not None:
            logits = logits.flatten().index_fill(0, batch.banned, float("-inf"))
            logits = logits.view(num_rows, -1)

        if batch.all_greedy:
            next_ids = greedy_ids(logits, self.kernels)
        else:
            next_ids = self._sample(logits, batch)
            if batch.any_greedy:
                next_ids = torch.where(batch.is_greedy, logits.argmax(dim=-1), next_ids)

        if batch.needs_logprobs:
            logprobs = raw_logprobs.gather(1, next_ids[:, None]).squeeze(1)
        return SampleOutput(next_ids, logprobs, top_ids, top_vals)

    def _greedy_banned(self, logits: torch.Tensor, flat_ids: torch.Tensor) -> torch.Tensor:
        """The argmax of each row with its banned ids (flat indices into logits) left out.

        NOTE: no copy of the logits: the banned entries go to -inf in place for the argmax and
        get their values back after it, so the caller's tensor ends as it came: an fp32 copy
        and an out-of-place fill of [256, 128k] logits cost a W1 llama-1b decode step, whose
        requests all ban EOS until their last token, a measurable share (docs/benchmarks.md,
        "What each feature is worth": greedy batch with banned ids). An overlapping view (an
        expanded row) is filled out of place instead."""
        if not logits.is_contiguous():
            masked = logits.flatten().index_fill(0, flat_ids, float("-inf"))
            return greedy_ids(masked.view(logits.shape), self.kernels)
        # (inference mode: a CUDA graph's logits are an inference tensor, which only takes
        # in-place writes there)
        with torch.inference_mode():
            flat = logits.view(-1)
            saved = flat[flat_ids]
            flat.index_fill_(0, flat_ids, float("-inf"))
            ids = greedy_ids(logits, self.kernels)
            flat.index_put_((flat_ids,), saved)  # duplicates put the same value back
        return ids

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        vocab_size = logits.shape[1]
        scaled = logits / batch.temperatures[:, None]  # [B, V]
        # Every filter keeps the tokens whose scaled logit is >= a per-row threshold; ties at the
        # threshold are all kept, so the result does not depend on the sort's tie order.
        threshold = None
        if batch.needs_sort:
            sorted_logits = scaled.sort(dim=-1, descending=True).values  # [B, V]
            positions = torch.arange(vocab_size, device=logits.device)
            outside_k = positions[None, :] >= batch.top_ks[:, None]
            probs = torch.softmax(sorted_logits.masked_fill(outside_k, float("-inf")), dim=-1)
            # Nucleus: keep while the cumulative prob *before* the token is < p (includes the
            # token that crosses p). Both masks are suffixes, so the kept set is a prefix.
            before = probs.cumsum(dim=-1) - probs
            removed = outside_k | (before >= batch.top_ps[:, None])
            num_kept = (~removed).sum(dim=-1, keepdim=True)  # >= 1: position 0 is never removed
            threshold = sorted_logits.gather(1, num_kept - 1).squeeze(1)  # [B]
        if batch.needs_min_p:
            # prob >= min_p * max_prob  <=>  logit >= max_logit + log(min_p); renormalizing after
            # top-k/top-p does not change the ratio, and the max token always survives them.
            row_max = scaled.amax(dim=-1)
            min_p_threshold = row_max + torch.log(batch.min_ps)  # -inf where min_p == 0
            threshold = (
                min_p_threshold if threshold is None else torch.maximum(threshold, min_p_threshold)
            )

        u = uniforms(row_keys(batch.seeds, batch.steps), self.vocab_hash(vocab_size, logits.device))
        scores = scaled - torch.log(-torch.log(u))  # Gumbel-max == exponential race
        if threshold is not None:
            scores = scores.masked_fill(scaled < threshold[:, None], float("-inf"))
        return scores.argmax(dim=-1)
