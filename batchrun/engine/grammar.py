"""Structured output with xgrammar: a compile cache, one matcher per request, the token bitmask.

    add_request --compile(spec)----------> Future (thread pool; cached per GrammarSpec)
    compiled    --matcher(compiled)-------> Req.matcher (one per request, n > 1 included)
    each step   --fill_mask(matchers, rows)-> pinned bitmask [S, V/32] -> device (async copy)
                --apply(logits, mask)-----> disallowed tokens' logits = -inf, in place

Compiles run on worker threads (xgrammar releases the GIL), so a new schema never stalls the
step loop; the engine admits a request once its future is done. Compile errors are cached like
grammars, so a bad schema repeated over many rows is parsed once.

xgrammar is imported lazily: an engine that never sees a grammar neither imports nor pays for it.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from array import array
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import msgspec
import torch

from batchrun.params import GrammarSpec

# compiled grammars kept (LRU); a JSON schema's compiled form holds per-token masks: ~MBs
CACHE_SIZE = 512
FILL_THREADS = 4  # at most; C++ threads of each shard's bitmask fill
# a fill job of many rows is split into this many shards, each accepting and then filling its own
# requests' rows on a thread of its own (structured.py), so the accepts run in parallel too
FILL_SHARDS = 1
# the GIL switch interval while structured output runs (Python's default is 5 ms)
GIL_SWITCH_S = 0.0002
# xgrammar prefixes its errors with a timestamp and a C++ source location: not for users
_LOCATION = re.compile(r"^\s*(\[[0-9:]+\]\s*)?\S+\.(cc|h):\d+:\s*")


class GrammarError(ValueError):
    """A spec that does not compile; the message is the compiler's."""


def compiler_message(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return _LOCATION.sub("", text).strip()


def choice_ebnf(choices: list[str]) -> str:
    """`root ::= "a" | "b"`: JSON string escapes are also EBNF string escapes."""
    return "root ::= " + " | ".join(msgspec.json.encode(c).decode() for c in choices)


def describe(spec: GrammarSpec) -> str:
    return {"json_schema": "JSON schema", "ebnf": "EBNF grammar"}.get(spec.kind, spec.kind)


def check_spec(spec: GrammarSpec) -> None:
    """Parse a spec without a tokenizer (fast; for the CLI's defaults). Raises GrammarError."""
    import xgrammar as xgr

    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(spec.spec, any_whitespace=False)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.spec)
        elif spec.kind == "ebnf":
            xgr.Grammar.from_ebnf(spec.spec)
        elif spec.kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(msgspec.json.decode(spec.spec)))
    except Exception as e:
        raise GrammarError(f"invalid {describe(spec)}: {compiler_message(e)}") from None


class TokenMask(NamedTuple):
    """The bitmask of one step, on the logits' device: rows `indices` of `bitmask` apply to the
    same rows of the logits; the other rows are stale and never read."""

    bitmask: torch.Tensor  # [S, ceil(V / 32)] int32, bit j of a row: token j allowed
    indices: torch.Tensor  # [G] int32 (on the device)
    indices_cpu: list[int]
    row_flags: torch.Tensor | None = None  # [S] int32 on the device: 1 for the rows masked


class GrammarBackend:
    """Compiles specs for one tokenizer and fills bitmasks; one per engine, made on first use.

    tokenizer: the HF tokenizer (or an xgrammar TokenizerInfo); vocab_size: the logits' width,
    which may exceed the tokenizer's (ids beyond it are never allowed); stop_token_ids: the
    tokens that end a completed grammar (the model's EOS ids); max_rows: sampling rows per step.

    NOTE: xgrammar sees the tokenizer's own vocabulary, not the padded logits width: padding ids
    make accept_token and the bitmask fill ~10x slower (49k tokenizer, 128k logits). The ids
    past the tokenizer are masked apart, on the device.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        max_rows: int,
        device: torch.device,
        max_workers: int | None = None,
    ) -> None:
        import xgrammar as xgr

        # NOTE: the fill job's thread needs the GIL for moments between its C++ calls (xgrammar's
        # Python wrappers); at the default 5 ms switch interval it waits that long for the step
        # loop's pure-Python stretches (process, schedule), and the sampling waits for it.
        # Process-wide, and set only in a process that uses a grammar.
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's vocab)
        self.mask_vocab = min(vocab_size, _tokenizer_size(tokenizer, stop_token_ids))
        self.device = device
        cpus = os.cpu_count() or 1
        self._executor = ThreadPoolExecutor(
            max_workers or min(4, cpus), thread_name_prefix="batchrun-grammar"
        )
        # NOTE: TokenizerInfo reads the whole vocabulary (slow for a 128k vocabulary): built on a
        # worker too, by the first job; compile jobs wait for it there, never the step loop
        self._compiler: Future = self._executor.submit(
            self._make_compiler, tokenizer, self.mask_vocab, list(stop_token_ids), min(8, cpus)
        )
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        # NOTE: fills rows on C++ threads: at most 4, which fill as fast as 8 and slow the step
        # loop less, where "auto" (half the cores) is slower on a 32-core host
        # (docs/benchmarks.md, "Structured output (W4)")
        self._xgr_batch = xgr.BatchGrammarMatcher
        self.set_fill_parallelism(
            max(1, min(FILL_THREADS, cpus // 2)), max(1, min(FILL_SHARDS, cpus // 2))
        )
        is_cuda = device.type == "cuda"
        width = (self.mask_vocab + 31) // 32
        self._mask_cpu = torch.full((max_rows, width), -1, dtype=torch.int32, pin_memory=is_cuda)
        self._mask_dev = (
            torch.full((max_rows, width), -1, dtype=torch.int32, device=device)
            if is_cuda
            else self._mask_cpu
        )
        self._copied = torch.cuda.Event() if is_cuda else None  # the last H2D copy of the mask
        # the rows the mask applies to (pinned, and a device copy the kernel reads)
        self._rows_cpu = torch.zeros(max_rows, dtype=torch.int32, pin_memory=is_cuda)
        self._rows_dev = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self._all_rows = torch.arange(max_rows, dtype=torch.int32, device=device)
        self._all_flags = torch.ones(max_rows, dtype=torch.int32, device=device)
        self._triton = None  # kernels/token_bitmask.py, or False: unpack with torch ops
        self._argmax = None  # its masked_argmax, or False

    @staticmethod
    def _make_compiler(tokenizer, vocab_size: int, stop_ids: list[int], threads: int):
        import xgrammar as xgr

        if isinstance(tokenizer, xgr.TokenizerInfo):  # tests: a made-up vocabulary
            info = tokenizer
        else:
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids or None
            )
        # NOTE: our LRU of futures is the cache; xgrammar's own would hold the same grammars
        return xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)

    # -- compiling -----------------------------------------------------------------------------

    def compile(self, spec: GrammarSpec) -> Future:
        """A future of the compiled grammar (raises GrammarError); cached per spec."""
        future = self._cache.get(spec)
        if future is not None:
            self._cache.move_to_end(spec)
            return future
        future = self._executor.submit(self._compile, spec)
        self._cache[spec] = future
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)  # a request holding the future keeps its result
        return future

    def _compile(self, spec: GrammarSpec):
        compiler = self._compiler.result()
        try:
            if spec.kind == "json_schema":
                # NOTE: compact JSON (", " and ": " between items, no other whitespace): with
                # free whitespace a small model can emit newlines until max_tokens
                return compiler.compile_json_schema(spec.spec, any_whitespace=False)
            if spec.kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if spec.kind == "regex":
                return compiler.compile_regex(spec.spec)
            if spec.kind == "ebnf":
                return compiler.compile_grammar(spec.spec)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_ebnf(msgspec.json.decode(spec.spec)))
        except Exception as e:
            raise GrammarError(f"invalid {describe(spec)}: {compiler_message(e)}") from None
        raise GrammarError(f"unknown grammar kind {spec.kind!r}")

    @staticmethod
    def matcher(compiled) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- the matchers and the bitmask --------------------------------------------------------

    @staticmethod
    def accept_tokens(matchers: list, tokens: list[int]) -> list[bool] | None:
        """Each matcher accepts its token (one call into C++, which releases the GIL). Returns
        None when all of them accepted (the usual case), else a flag per matcher. No matcher
        may appear twice."""
        core_call = _core_batch_accept()
        if core_call is None:
            import xgrammar as xgr

            ok = xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
            return None if all(ok) else ok
        result = core_call([m._handle for m in matchers], tokens, False)
        # NOTE: `in` on the result is one call into C++; the public wrapper converts the result
        # element by element under the GIL, a cost per row that the step loop waits for
        return None if 0 not in result else [bool(x) for x in result]  # flags come as 0 / 1

    def fill_mask(self, matchers: list, rows: list[int]) -> TokenMask:
        """Fill bitmask row rows[i] from matchers[i] on the CPU and start its copy to the device.
        rows: positions in the step's sampling batch (the logits' rows)."""
        self.fill_rows(matchers, rows)
        return self.upload(rows)

    def set_fill_parallelism(self, threads: int, shards: int) -> None:
        """Fill jobs from now on: `shards` parts on threads of their own (StructuredOutput),
        each filling its rows on `threads` C++ threads. Not while a fill job runs."""
        if threads < 1 or shards < 1:
            raise ValueError(f"threads and shards must be >= 1; got {threads}, {shards}")
        self.fill_threads, self.fill_shards = threads, shards
        self._batches = [self._xgr_batch(threads) for _ in range(shards)]

    def fill_rows(self, matchers: list, rows: list[int], shard: int = 0) -> None:
        """The CPU half of fill_mask; safe on another thread while the caller's thread does
        other work (nothing else touches these matchers or the pinned buffer meanwhile), and
        from the threads of different shards at once (disjoint rows)."""
        if self._copied is not None:
            # the previous step's copy must have left the pinned buffer before we rewrite it
            # (normally long done: the host has waited for that step's results since)
            self._copied.synchronize()
        self._batches[shard].batch_fill_next_token_bitmask(matchers, self._mask_cpu, rows)

    def upload(self, rows: list[int]) -> TokenMask:
        """The device half of fill_mask: start the copy of the filled rows (stream order)."""
        num_rows = max(rows) + 1
        if self._copied is None:
            indices = torch.tensor(rows, dtype=torch.int32)
            return TokenMask(self._mask_cpu[:num_rows], indices, rows)
        dev = self._mask_dev[:num_rows]
        dev.copy_(self._mask_cpu[:num_rows], non_blocking=True)
        self._rows_cpu[: len(rows)].copy_(torch.frombuffer(array("i", rows), dtype=torch.int32))
        indices = self._rows_dev[: len(rows)]
        indices.copy_(self._rows_cpu[: len(rows)], non_blocking=True)
        self._copied.record()
        return TokenMask(dev, indices, rows)

    def upload_gated(
        self,
        rows: list[int],
        num_sampling: int,
        gate,
        ticket: int,
        stream,
        staging,
        events: tuple | None = None,
    ) -> TokenMask:
        """upload() while the rows may still be being filled: the copy is enqueued behind the
        gate (host_gate.py) that the running fill job opens with `ticket` once it has filled
        every row in `rows` (those it does not constrain it sets to allow all: allow_all), of
        a step that samples `num_sampling` rows. Row indices and flags go through the staging
        ring: the next step's launch may come before this copy runs. events: three timing
        events, recorded before the gate, after it and after the bitmask's copy."""
        num_rows = max(rows) + 1
        if len(rows) == num_sampling:  # every row (rows ascend): the usual all-grammar batch
            indices, flags = self._all_rows[:num_rows], self._all_flags[:num_rows]
        else:
            indices = staging.to_device(rows, torch.int32)
            marks = [0] * num_sampling
            for r in rows:
                marks[r] = 1
            flags = staging.to_device(marks, torch.int32)
        if events is not None:  # timing: the device's wait at the gate, then the copy
            events[0].record(stream)
        gate.close(stream, ticket)
        if events is not None:
            events[1].record(stream)
        dev = self._mask_dev[:num_rows]
        # NOTE: no event: the next fill job rewrites the pinned rows only after this step's
        # tokens reached the host, long after this copy ran
        dev.copy_(self._mask_cpu[:num_rows], non_blocking=True)
        if events is not None:
            events[2].record(stream)
        return TokenMask(dev, indices, rows, flags)

    def greedy(self, logits: torch.Tensor, mask: TokenMask) -> torch.Tensor | None:
        """Each row's argmax over the tokens its mask allows (rows without a mask: over all),
        in one pass over the logits; None where that kernel cannot run (then apply() and the
        sampler). For a batch whose sampling is plain greedy (SamplingBatch.is_plain_greedy)."""
        if mask.row_flags is None or logits.device.type != "cuda":
            return None
        if self._argmax is None:
            try:
                from batchrun.kernels.token_bitmask import masked_argmax

                self._argmax = masked_argmax
            except ImportError:
                self._argmax = False
        if not self._argmax:
            return None
        return self._argmax(logits, mask.bitmask, mask.row_flags, self.mask_vocab)

    def allow_token(self, row: int, token: int) -> None:
        """Bitmask row `row` allows `token` too (after its fill)."""
        word, bit = divmod(token, 32)
        value = (int(self._mask_cpu[row, word]) & 0xFFFFFFFF) | (1 << bit)
        self._mask_cpu[row, word] = value - (1 << 32) if value >= 1 << 31 else value

    def allow_all(self, rows: list[int]) -> None:
        """Bitmask rows that allow every token (rows of a gated upload the job leaves alone)."""
        for row in rows:
            self._mask_cpu[row].fill_(-1)

    @torch.inference_mode()  # the logits are inference tensors (the model runs in that mode)
    def apply(self, logits: torch.Tensor, mask: TokenMask) -> None:
        """Set the logits [S, V] of disallowed tokens to -inf, in place (rows mask.indices)."""
        vocab = self.mask_vocab
        if logits.device.type == "cpu":
            import xgrammar as xgr

            xgr.apply_token_bitmask_inplace(
                logits, mask.bitmask, vocab_size=vocab, indices=mask.indices_cpu
            )
            if vocab < logits.shape[-1]:
                logits[mask.indices_cpu, vocab:] = float("-inf")
            return
        if self._triton is None:
            try:
                from batchrun.kernels.token_bitmask import apply_token_bitmask_

                self._triton = apply_token_bitmask_
            except ImportError:  # no triton: torch ops
                self._triton = False
        if self._triton:
            # one launch: the bitmask rows, and -inf past the tokenizer's vocabulary
            self._triton(logits, mask.bitmask, mask.indices, vocab)
            return
        apply_mask_torch(logits[:, :vocab], mask.bitmask, mask.indices)
        if vocab < logits.shape[-1]:
            logits[:, vocab:].index_fill_(0, mask.indices.long(), float("-inf"))


@functools.cache
def _core_batch_accept():
    """xgrammar's C++ batch accept without its Python wrapper, or None where this xgrammar lays
    it out differently (then the public API is used). Checked against xgrammar 0.2.9."""
    try:
        from xgrammar.base import _core

        return _core.BatchGrammarMatcher.batch_accept_token
    except (ImportError, AttributeError):
        return None


def _tokenizer_size(tokenizer: Any, stop_token_ids: list[int]) -> int:
    """Ids a grammar may allow: the tokenizer's vocabulary (with added tokens) and the stops."""
    size = tokenizer.vocab_size if hasattr(tokenizer, "decoded_vocab") else len(tokenizer)
    return max(size, *(t + 1 for t in stop_token_ids)) if stop_token_ids else size


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 bits -> [R, vocab_size] bool (True: allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    return bits.flatten(1)[:, :vocab_size].bool()


def apply_mask_torch(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor) -> None:
    """The same as the Triton kernel with torch ops (no host sync)."""
    idx = indices.long()
    allowed = unpack_bitmask(bitmask.index_select(0, idx), logits.shape[-1])
    rows = logits.index_select(0, idx).masked_fill(~allowed, float("-inf"))
    logits.index_copy_(0, idx, rows)
