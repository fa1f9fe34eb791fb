"""The engine: takes token-id requests and yields finished results.

    engine = Engine(EngineConfig(model="path/to/model"))
    for result in engine.generate(requests):   # requests: iterable of GenerateRequest
        ...

`generate` pulls requests lazily (at most config.max_pending waiting), runs steps with `step()`
and yields each completion as it finishes. The loop is a plain `while has work: step()`.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from batchrun.chat.markers import ThinkMarkers, think_markers
from batchrun.config import EngineConfig, KernelPlan, resolve_sizes
from batchrun.engine.allocator import TokenAllocator
from batchrun.engine.gc_pause import frozen_gc
from batchrun.engine.grammar import GrammarBackend
from batchrun.engine.host_gate import HostGate
from batchrun.engine.kernel_choice import resolve_kernels
from batchrun.engine.kv_manager import KVManager
from batchrun.engine.model_runner import ModelRunner, StepHandle, resolve_device
from batchrun.engine.radix_cache import RadixCache
from batchrun.engine.request import Req
from batchrun.engine.sampler import SamplingBatch
from batchrun.engine.scheduler import ScheduledBatch, Scheduler
from batchrun.engine.stop import StopStringChecker
from batchrun.engine.structured import GateRelease, StructuredOutput
from batchrun.engine.thinking import AnswerGate, ThinkingBudget
from batchrun.engine.window_tree import TreeWindows
from batchrun.models.config import ModelConfig
from batchrun.models.context import served_context_len
from batchrun.models.embedded import resolve_model_path
from batchrun.models.hub import load_tokenizer
from batchrun.params import (
    EngineCounters,
    GenerateRequest,
    GenerateResult,
    TopLogprobs,
    check_input_ids,
)
from batchrun.quant.online import with_quantization


@dataclass
class EngineStats:
    num_finished: int = 0
    # prompt / cached / output tokens of finished requests
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    # output tokens as the host sees them, step by step, of finished and running requests
    generated_tokens: int = 0
    num_steps: int = 0
    num_forward_tokens: int = 0
    forward_time: float = 0.0
    # grammar steps sampled behind a host gate (CUDA with overlap): the device's seconds waiting
    # at the gate for the fill job, and copying the bitmask after it
    num_gated_steps: int = 0
    gate_wait_time: float = 0.0
    mask_copy_time: float = 0.0

    @property
    def cached_fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class _Launched(NamedTuple):
    reqs: list[Req]  # the requests that sample a token in this step
    out_index: list[int]  # the output index each of them fills
    handle: StepHandle  # with `pending` set: the sampling waits for the token bitmask
    fill: Future | None = None  # a gated step's fill job (on the fill thread)
    gate: GateRelease | None = None  # its sampling waits behind a gate the fill job opens
    gate_events: tuple | None = None  # timing around that gate (EngineStats.gate_wait_time)


def drive(engine, requests: Iterable[GenerateRequest]) -> Iterator[GenerateResult]:
    """Feed `engine` (anything with add_request / wants_requests / has_work / step) from an
    iterable, a bounded look-ahead at a time, and yield every result until all are done. The
    objects alive at the start stay out of the garbage collector's passes until the end
    (gc_pause.frozen_gc)."""
    pending = iter(requests)
    exhausted = False
    with frozen_gc():
        while True:
            while not exhausted and engine.wants_requests:
                request = next(pending, None)
                if request is None:
                    exhausted = True
                    break
                engine.add_request(request)
            if not engine.has_work:
                if exhausted:
                    return
                continue
            yield from engine.step()


def derive_seed(base: int, rid: str, index: int = 0) -> int:
    digest = hashlib.blake2b(f"{base}\0{rid}\0{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


class Engine:
    def __init__(self, config: EngineConfig, kernels: KernelPlan | None = None):
        """kernels: plan fields set by a benchmark or a test (engine/kernel_choice.py checks
        them); None: the plan is the rules' alone."""
        config.validate()
        self.model_dir = self._resolve_model_dir(config)
        # the checkpoint's quantization, or --quantization's
        self.model_config = with_quantization(
            ModelConfig.from_dir(self.model_dir), config.quantization, config.model
        )
        device = resolve_device(config.device)
        config = resolve_sizes(config, self.model_config)
        # overlap needs an asynchronous device; on the CPU every op is synchronous anyway
        overlap = config.overlap if config.overlap is not None else device.type == "cuda"
        config = replace(config, overlap=overlap)
        plan = resolve_kernels(config, self.model_config, device, kernels)
        self.context_len = served_context_len(config.context_len, self.model_config)
        self.runner = ModelRunner(config, plan, self.model_config, self.model_dir, self.context_len)
        self.config = config
        self.device = self.runner.device
        allocator = TokenAllocator(self.runner.num_slots, config.page_size)
        # a hybrid's matches end at its state snapshots (engine/state_snapshots.py), a windowed
        # model's where the tree holds the window (engine/window_tree.py)
        window = self.runner.window
        tree_windows = None
        if window is not None and config.enable_radix_cache:
            tree_windows = TreeWindows(window)
        cache = RadixCache(
            allocator,
            config.page_size,
            disable=not config.enable_radix_cache,
            snapshots=self.runner.snapshots,
            windows=tree_windows,
        )
        self.kv = KVManager(allocator, cache, self.runner.req_pool, window)
        # with the sliding layers' window pool, at most the requests whose windows it holds run
        max_running = (
            config.max_running if window is None else min(config.max_running, window.max_requests)
        )
        self.scheduler = Scheduler(
            self.kv, max_running, config.chunked_prefill_size, config.new_token_ratio
        )
        self.eos_token_ids = tuple(self.model_config.eos_token_ids)
        self.stats = EngineStats()
        self._tokenizer = None
        self._stop_checker: StopStringChecker | None = None
        # the tokenizer's (thinking budgets, grammars after the thinking); False: it has none
        self._think_markers: ThinkMarkers | bool | None = None
        self._has_budgets = False  # a request with a thinking budget came: steps look for them
        self._arrivals = 0
        self._finished: list[GenerateResult] = []
        self._inflight: _Launched | None = None
        self._rejected: list = []  # (req, output index, token) a matcher refused
        self.structured = StructuredOutput(
            self._make_grammar_backend,
            self.eos_token_ids,
            wait_for_compiles=config.tp_size > 1,
        )
        self.overlap = overlap
        # with overlap on CUDA, a grammar step's sampling is enqueued at once behind a gate
        # (host_gate.py) that its fill job opens; else it is sampled in line (_sample_constrained)
        self.gate = HostGate.create(self.device) if self.kernels.host_gate else None

    @property
    def kernels(self) -> KernelPlan:
        """The kernel plan this engine runs, as the model made it (decode_norms may step
        down)."""
        return self.runner.kernels

    @staticmethod
    def _resolve_model_dir(config: EngineConfig) -> Path:
        return resolve_model_path(config.model)

    @property
    def tokenizer(self):
        """The model directory's tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_dir)
        return self._tokenizer

    @property
    def num_kv_slots(self) -> int:
        return self.runner.num_slots

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to vocab_size - 1 (the model's embedding rows)."""
        return self.model_config.vocab_size

    @property
    def counters(self) -> EngineCounters:
        """Tokens so far and the gauges of the moment, from host-side counters only (no device
        work, no sync)."""
        stats, sched, kv = self.stats, self.scheduler, self.kv
        return EngineCounters(
            num_steps=stats.num_steps,
            num_forward_tokens=stats.num_forward_tokens,
            forward_time=stats.forward_time,
            generated_tokens=stats.generated_tokens,
            admitted_tokens=sched.num_admitted_tokens,
            admitted_cached_tokens=sched.num_admitted_cached_tokens,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting) + self.structured.num_compiling,
            kv_used=kv.allocator.capacity - kv.available,
            kv_total=kv.allocator.capacity,
        )

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, request: GenerateRequest) -> None:
        """Queue a request; a ValueError (nothing queued) when its input_ids or params are not
        valid or it does not fit the context length."""
        params = request.params
        input_ids = check_input_ids(request.rid, request.input_ids, self.model_config.vocab_size)
        params.validate(self.model_config.vocab_size)
        total = len(input_ids) + params.max_new_tokens
        if total > self.context_len:
            raise ValueError(
                f"request {request.rid!r}: {len(input_ids)} prompt tokens + "
                f"max_new_tokens {params.max_new_tokens} exceed the context length "
                f"{self.context_len}; shorten the prompt or lower max_new_tokens"
            )
        if params.stop and self._stop_checker is None:
            self._stop_checker = StopStringChecker(self.tokenizer)
        markers = self._markers_for(request) if params.max_thinking_tokens else None
        # a thinking model's grammar applies to its answer (thinking.AnswerGate)
        answer_markers = self._thinking_markers() if params.grammar is not None else None
        base = (
            params.seed if params.seed is not None else derive_seed(self.config.seed, request.rid)
        )
        reqs = []
        for i in range(params.n):
            seed = base if i == 0 else derive_seed(base, request.rid, i)
            self._arrivals += 1
            ids = input_ids if i == 0 else list(input_ids)
            reqs.append(Req(request.rid, i, ids, params, seed, self._arrivals))
            if markers is not None:
                reqs[-1].budget = ThinkingBudget.create(markers, params.max_thinking_tokens, ids)
                self._has_budgets = True
            if answer_markers is not None:
                limit = params.max_thinking_tokens
                reqs[-1].answer_gate = AnswerGate.create(answer_markers, limit, ids)
        if params.grammar is None:
            for req in reqs:
                self.scheduler.add(req)
        else:
            # NOTE: admitted once compiled (a cached grammar: at once); requests behind go ahead
            self.structured.submit(reqs, params.grammar)
            self._admit_compiled()

    def _thinking_markers(self) -> ThinkMarkers | None:
        """The tokenizer's thinking markers (None: not a thinking model)."""
        if self._think_markers is None:
            self._think_markers = think_markers(self.tokenizer) or False
        return self._think_markers or None

    def _markers_for(self, request: GenerateRequest) -> ThinkMarkers:
        markers = self._thinking_markers()
        if markers is None:
            raise ValueError(
                f"request {request.rid!r}: max_thinking_tokens needs a thinking model; this "
                "tokenizer has no <think> / </think> or harmony (<|channel|>) tokens"
            )
        return markers

    @property
    def grammar(self) -> GrammarBackend:
        """The structured-output backend (made on first use)."""
        return self.structured.backend

    def _make_grammar_backend(self) -> GrammarBackend:
        vocab_size, max_rows = self.model_config.vocab_size, self.config.max_running
        return GrammarBackend(
            self.tokenizer, vocab_size, list(self.eos_token_ids), max_rows, self.device
        )

    def _admit_compiled(self, idle: bool = False) -> None:
        for req in self.structured.poll(idle):
            if req.is_finished:  # the spec did not compile
                self._finished.append(self._result(req))
            else:
                self.scheduler.add(req)

    @property
    def wants_requests(self) -> bool:
        """Room in the waiting queue: feed more (bounded look-ahead, as generate() does)."""
        num_waiting = len(self.scheduler.waiting) + self.structured.num_compiling
        return num_waiting < self.config.max_pending

    def drop_waiting(self) -> int:
        """Forget the requests that have not started (they hold no KV); running ones go on.
        For a graceful stop: drain what runs, resume the rest later. Returns how many."""
        dropped = len(self.scheduler.waiting) + self.structured.clear()
        self.scheduler.waiting.clear()
        return dropped

    @property
    def has_work(self) -> bool:
        return (
            self.scheduler.has_work
            or self._inflight is not None
            or self.structured.num_compiling > 0
            or bool(self._finished)  # e.g. a grammar that failed to compile, not yet reported
        )

    def generate(self, requests: Iterable[GenerateRequest]) -> Iterator[GenerateResult]:
        return drive(self, requests)

    # -- one step ---------------------------------------------------------------------------

    def step(self) -> list[GenerateResult]:
        """One turn of the loop; returns the completions it finished.

        With overlap (CUDA), step n+1 is scheduled and launched while the device still runs
        step n, and step n's results are processed after that launch:

            schedule(n+1) -> launch(n+1) -> wait + process(n) -> schedule(n+2) -> ...

        The tokens of step n feed step n+1 on the device (runner.token_pool); the host sees
        them one step late. Without overlap, each step is processed right after its launch.

        A step with grammar requests needs step n's tokens for its token bitmask (the matchers
        accept them first). With overlap on CUDA it flows like any other all the same (the
        step loop never waits for the grammar work): its fill job starts right after n+1 is
        scheduled, on the fill thread, and takes step n's tokens itself as they land; the
        sampling of n+1 is enqueued right after forward(n+1), behind a gate on the stream that
        the job opens once the bitmask is filled (host_gate.py), so the device waits there only
        if the job is not done when forward(n+1) is:

            schedule(n+1) -> start job(n+1) -> launch forward(n+1), gate, sample(n+1)
            -> wait + process(n) -> schedule(n+2) -> ...

        Without a gate (CPU, KernelPlan.host_gate off) a grammar step is sampled in line,
        once the step before it is processed; without overlap each step is processed before
        the next.
        """
        sched = self.scheduler
        in_flight = self._inflight is not None
        self._admit_compiled(idle=not sched.has_work and not in_flight)
        # nothing runs and nothing is in flight: if the head of the queue cannot be scheduled
        # now, it never can
        idle = not sched.running and not in_flight
        batch = sched.schedule()
        if batch is None and sched.needs_sync and self._inflight is not None:
            # only a request with tokens in flight could make room: settle them, try again
            self._process(self._inflight)
            self._inflight = None
            batch = sched.schedule()
        self._collect_aborted()
        launched = None
        if batch is not None:
            launched = self._launch(batch)
        if self._inflight is not None:
            # (a gated step's fill job took the grammar tokens of this one already)
            self._process(self._inflight, queued=launched is not None and launched.gate is not None)
            self._inflight = None
        if launched is not None and launched.handle.pending is not None:
            # a grammar step without a gate: its matchers need the tokens just processed
            launched = self._sample_constrained(launched)
        if launched is not None:
            if self.overlap:
                self._inflight = launched
            else:
                self._process(launched)
        elif batch is None and idle and sched.waiting:
            self._abort_unfittable(sched.waiting.popleft())
        if self._rejected:
            self._abort_rejected()
        return self._take_finished()

    def _launch(self, batch: ScheduledBatch) -> _Launched:
        sampling_reqs = [r for r, s in zip(batch.reqs, batch.sample_mask) if s]
        sampling = self._sampling_batch(sampling_reqs) if sampling_reqs else None
        # which output index each sampled token will fill
        out_index = [len(r.output_ids) for r in sampling_reqs]
        if sampling is not None and self._has_budgets:
            sampling = self._with_forced(sampling, sampling_reqs, out_index)
        constrained = sampling is not None and any(r.matcher is not None for r in sampling_reqs)
        gate = fill = gate_events = mask = None
        if constrained and self.gate is not None:
            # NOTE: the job starts before the gate closes: see host_gate.py
            gate, fill = self._start_gated_job(sampling_reqs)
            gate_events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
            mask = functools.partial(self._gated_mask, gate, len(sampling_reqs), gate_events)
        # without a gate, a grammar step is sampled once the step before is processed
        # (_sample_constrained)
        defer = constrained and gate is None
        handle = self.runner.launch(batch, sampling, mask, defer)
        self.scheduler.advance(batch)
        self.stats.num_steps += 1
        self.stats.num_forward_tokens += batch.num_tokens
        return _Launched(sampling_reqs, out_index, handle, fill, gate, gate_events)

    def _with_forced(
        self, sampling: SamplingBatch, reqs: list[Req], out_index: list[int]
    ) -> SamplingBatch:
        """`sampling` with the thinking budgets' forced tokens of this step (engine/thinking.py)."""
        cols: list[list[int]] = [[], [], []]
        for i, req in enumerate(reqs):
            if req.budget is None:
                continue
            j = out_index[i]
            o = req.budget.override(j, req.output_ids, j - req.num_inflight)
            if o is not None:
                cols[0].append(i)
                cols[1].append(o[0])
                cols[2].append(o[1])
        if not cols[0]:
            return sampling
        flat = cols[0] + cols[1] + cols[2]
        forced = self.runner.staging.to_device(flat, torch.int64).view(3, -1)
        return replace(sampling, forced=forced)

    def _start_gated_job(self, reqs: list[Req]) -> tuple[GateRelease, Future]:
        """The fill job of a gated step sampling `reqs`: it takes the in-flight step's tokens
        itself, as soon as they reach the host, fills the bitmask rows the device will apply
        (those of requests with a grammar), and opens the gate."""
        rows = [i for i, r in enumerate(reqs) if r.matcher is not None]
        release = GateRelease(rows, self.gate, self.gate.next_ticket())
        prev = self._inflight
        if prev is None:
            return release, self.structured.start_fill(reqs, release=release)
        tokens = functools.partial(self.runner.host_tokens, prev.handle)
        fill = self.structured.start_fill_after(
            prev.reqs, prev.out_index, tokens, reqs, release=release
        )
        return release, fill

    def _gated_mask(self, gate: GateRelease, num_sampling: int, events: tuple):
        """(mask, grammar) of a gated grammar step, enqueued after its forward: the bitmask's
        copy and all after it wait on the device until the step's fill job (running) has
        filled the rows."""
        grammar, stream, staging = self.grammar, self.runner.stream, self.runner.staging
        mask = grammar.upload_gated(
            gate.rows, num_sampling, gate.gate, gate.ticket, stream, staging, events
        )
        return mask, grammar

    def _sample_constrained(self, launched: _Launched) -> _Launched:
        """Fill the grammar rows' token bitmask in line (their matchers accept every earlier
        token first) and launch the sampling of the step's logits."""
        mask, rejected = self.structured.fill_mask(launched.reqs)
        self._rejected.extend(rejected)  # aborted at the end of step()
        grammar = self.grammar if mask is not None else None
        handle = self.runner.sample_pending(launched.handle, mask, grammar)
        return launched._replace(handle=handle)

    def _process(self, launched: _Launched, queued: bool = False) -> None:
        """Take a step's tokens: finish the requests they end. queued: a fill job took this
        step's grammar tokens already (the gated step launched after it)."""
        out = self.runner.wait(launched.handle)
        if launched.fill is not None:  # a gated step: its sampling ran after the job
            self._rejected.extend(self.structured.finish_gated(launched.fill))
        if launched.gate_events is not None:
            # (recorded before the step's results, which the wait above saw on the host)
            before, opened, copied = launched.gate_events
            self.stats.num_gated_steps += 1
            self.stats.gate_wait_time += before.elapsed_time(opened) / 1e3
            self.stats.mask_copy_time += opened.elapsed_time(copied) / 1e3
        num_new = 0
        for i, (req, idx) in enumerate(zip(launched.reqs, launched.out_index)):
            if req.is_finished:
                continue  # it finished on an earlier token; this one was a wasted decode
            num_new += 1
            req.num_inflight -= 1
            req.output_ids[idx] = out.next_token_ids[i]
            self._check_finish(req, idx, out, i, queued)
            if req.is_finished:
                # drop tokens launched after the finishing one
                del req.output_ids[idx + 1 :]
                req.num_inflight = 0
                self.scheduler.finish(req)
                self._finished.append(self._result(req))
        self.stats.generated_tokens += num_new
        self.stats.forward_time = self.runner.forward_time

    def _sampling_batch(self, reqs: list[Req]) -> SamplingBatch:
        rows = [r.row for r in reqs]
        for req in reqs:
            # (re)build penalty statistics the first time a request samples in a row
            if req.params.has_penalties and req.penalty_row != req.row:
                self.runner.penalties.reset_row(req.row, req.input_ids, req.output_ids)
                req.penalty_row = req.row
        return SamplingBatch.build(
            [r.params for r in reqs],
            [r.seed for r in reqs],
            [len(r.output_ids) for r in reqs],
            rows,
            self.model_config.vocab_size,
            list(self.eos_token_ids),
            self.device,
            self.runner.staging,
        )

    def _check_finish(self, req: Req, idx: int, out, i: int, queued: bool = False) -> None:
        """Set req.finish_reason if token idx ends it (queued: a grammar request's token is
        queued for its matcher already)."""
        token = req.output_ids[idx]
        params = req.params
        if params.logprobs or params.top_logprobs:
            if req.logprobs is None:
                req.logprobs, req.top_logprobs = [], []
            req.logprobs.append(out.logprobs[i])
            if params.top_logprobs and out.top_logprobs is not None:
                ids, vals = out.top_logprobs[i]
                req.top_logprobs.append((ids[: params.top_logprobs], vals[: params.top_logprobs]))
        num_out = idx + 1
        if req.matcher is not None and self.structured.record(req, idx, token, queued):
            return
        if token in params.stop_token_ids:
            req.finish_reason, req.matched_stop = "stop", token
        elif not params.ignore_eos and token in self.eos_token_ids:
            req.finish_reason, req.matched_stop = "stop", token
        elif (
            params.stop
            and num_out >= params.min_new_tokens
            and (hit := self._stop_checker.find(req, num_out)) is not None
        ):
            req.finish_reason, req.matched_stop = "stop", hit
        elif num_out >= params.max_new_tokens or len(req.input_ids) + num_out >= self.context_len:
            req.finish_reason = "length"

    def _result(self, req: Req) -> GenerateResult:
        stats = self.stats
        stats.num_finished += 1
        stats.output_tokens += len(req.output_ids)
        if req.index == 0:
            stats.prompt_tokens += len(req.input_ids)
        stats.cached_tokens += req.cached_tokens or 0
        top = None
        if req.top_logprobs:
            top = [TopLogprobs(list(ids), list(vals)) for ids, vals in req.top_logprobs]
        return GenerateResult(
            rid=req.rid,
            index=req.index,
            output_ids=req.output_ids,
            finish_reason=req.finish_reason or "abort",
            prompt_tokens=len(req.input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens or 0,
            matched_stop=req.matched_stop,
            logprobs=req.logprobs,
            top_logprobs=top,
            error=req.error,
        )

    def _abort_rejected(self) -> None:
        """A matcher rejected a token its bitmask allowed (a bug, not the row's fault): the
        request ends there, with the output up to that token."""
        rejected, self._rejected = self._rejected, []
        for req, idx, token in rejected:
            if req.is_finished:
                continue
            req.finish_reason = "abort"
            req.error = f"structured output: the grammar rejected sampled token {token}"
            del req.output_ids[idx + 1 :]
            req.num_inflight = 0
            if req.row is not None:  # running
                # with overlap, steps past that token are launched: their KV is not the request's
                req.kv_len = min(req.kv_len, req.seq_len)
                self.scheduler.finish(req)
            else:  # retracted since (its KV is released): waiting again
                self.scheduler.waiting.remove(req)
            self._finished.append(self._result(req))

    def _collect_aborted(self) -> None:
        # requests aborted by the scheduler were already released; report them
        for req in self.scheduler.drain_aborted():
            self._finished.append(self._result(req))

    def _abort_unfittable(self, req: Req) -> None:
        req.finish_reason = "abort"
        req.error = (
            f"needs {req.seq_len} KV slots at once but the pool holds {self.num_kv_slots}; "
            "raise --kv-budget"
        )
        self._finished.append(self._result(req))

    def _take_finished(self) -> list[GenerateResult]:
        done, self._finished = self._finished, []
        return done

    # -- tools for tests and scoring ------------------------------------------------------------

    def score(self, input_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits [T, V] (fp32) of one sequence; the engine must be idle."""
        assert not self.has_work, "score() needs an idle engine"
        slots = self.kv.allocate(self.kv.page_ceil(len(input_ids)))
        if slots is None:
            raise ValueError("sequence does not fit the KV pool")
        try:
            return self.runner.all_logits(input_ids, slots)
        finally:
            self.kv.allocator.free(slots)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
