"""The engine's side of structured output: requests wait here while their grammar compiles, their
matchers advance with each token the host sees, and a step's bitmask rows are chosen here.

    add_request -> submit(reqs, spec) --compile on a worker--> poll() -> req.matcher set, or
                                                                         req aborted (error)
    process(n)  -> record(req, idx, token): queued for the matcher; True on a stop token
    step n+1    -> fill_mask(sampling reqs), in line: the matchers accept the queued tokens
                   (a thinking model's: those of the answer, thinking.AnswerGate), then the
                   bitmask rows are filled (past the thinking) -> TokenMask for the model
                   runner (None: no rows), and the tokens a matcher rejected
    or, gated (CUDA with overlap: host_gate.py), as soon as step n+1 is scheduled:
                   start_fill_after(step n's reqs, their tokens (waits for them), n+1's reqs,
                   release): the same on the fill thread, which then opens the gate; step n's
                   tokens are recorded with queued=True; finish_gated reads the rejections

The xgrammar side (compiling, the bitmask buffers, the kernels) is in grammar.py.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, NamedTuple

from batchrun.engine.grammar import GrammarBackend, TokenMask
from batchrun.engine.request import Req
from batchrun.params import GrammarSpec

# (request, output index, token): a token recorded for the matchers (and, if they reject it, why
# the request aborts)
Recorded = tuple[Req, int, int]


class GateRelease(NamedTuple):
    """What a fill job does last for a gated sampling (host_gate.py): `rows` (the bitmask rows
    the device will apply) are all written, those it does not constrain set to allow all, then
    open() lets the device run on. Done whatever happens, errors included: a gate left closed
    hangs the device."""

    rows: list[int]
    gate: Any  # a HostGate
    ticket: int

    def open(self) -> None:
        self.gate.open(self.ticket)


# when nothing else runs, how long poll() waits for a compile (keeps the caller's loop alive:
# it still feeds requests and sees signals)
IDLE_WAIT_S = 0.05
# a sharded fill job gives each part at least this many rows (a part costs a thread handoff)
MIN_SHARD_ROWS = 16


class StructuredOutput:
    def __init__(
        self,
        make_backend: Callable[[], GrammarBackend],
        stop_token_ids: tuple[int, ...] = (),
        wait_for_compiles: bool = False,
    ) -> None:
        """stop_token_ids: the tokens that complete a grammar (the model's EOS ids, as given to
        the backend). wait_for_compiles: poll() waits for every compile in flight.
        Tensor-parallel ranks need it: each rank must admit a request at the same step,
        whatever its compile timing."""
        self._make_backend = make_backend
        self._stop_ids = frozenset(stop_token_ids)
        # tokens the host has seen and the matchers have not accepted yet (the next fill job's)
        self._accepts: list[Recorded] = []
        self._wait_for_compiles = wait_for_compiles
        self._backend: GrammarBackend | None = None
        self._compiling: list[tuple[Req, Future]] = []
        self._fill_thread: ThreadPoolExecutor | None = None  # bitmask fills (start_fill)
        self._shard_threads: ThreadPoolExecutor | None = None  # a sharded job's parts 1..
        self._shard_workers = 0

    @property
    def backend(self) -> GrammarBackend:
        """Made on first use: it imports xgrammar and reads the tokenizer's vocabulary."""
        if self._backend is None:
            self._backend = self._make_backend()
        return self._backend

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def clear(self) -> int:
        """Forget the requests still waiting for a compile; returns how many."""
        n, self._compiling = len(self._compiling), []
        return n

    def submit(self, reqs: list[Req], spec: GrammarSpec) -> None:
        """The requests (the n samples of one prompt) wait for spec's grammar; poll() hands
        them back. One compile per distinct spec: the backend caches them."""
        try:
            future = self.backend.compile(spec)
        except Exception as e:  # no xgrammar, no tokenizer: these rows fail, the job goes on
            future = Future()
            hint = " (pip install xgrammar)" if isinstance(e, ImportError) else ""
            future.set_exception(RuntimeError(f"structured output is unavailable: {e}{hint}"))
        self._compiling.extend((req, future) for req in reqs)

    def poll(self, idle: bool = False) -> list[Req]:
        """The requests whose compile has finished: each with its own matcher, or finished with
        finish_reason "abort" and the compiler's message. idle: nothing else to do, so wait a
        little for a compile rather than spin."""
        if not self._compiling:
            return []
        futures = [f for _, f in self._compiling]
        if self._wait_for_compiles:
            wait(futures)
        elif idle:
            wait(futures, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        done, still = [], []
        for req, future in self._compiling:
            if not future.done():
                still.append((req, future))
                continue
            error = future.exception()
            if error is None:
                req.matcher = self.backend.matcher(future.result())
            else:
                req.finish_reason, req.error = "abort", str(error)
            done.append(req)
        self._compiling = still
        return done

    def record(self, req: Req, idx: int, token: int, queued: bool = False) -> bool:
        """The host saw `token` at output index `idx` of a grammar request. Its matcher accepts
        it in the next fill job (queued: a job running start_fill_after took it already). True
        when the token ends the request: a stop token (EOS), which the bitmask allows only
        where the grammar may end, so accepting it terminates the matcher. A token the matcher
        rejects (a bug, not the row's fault) aborts the request when that job's result is read
        (finish_fill, finish_gated)."""
        if not queued:
            self._accepts.append((req, idx, token))
        if token in self._stop_ids:
            req.finish_reason, req.matched_stop = "stop", token
            return True
        return False

    def fill_mask(self, reqs: list[Req]) -> tuple[TokenMask | None, list[Recorded]]:
        """The bitmask of a step's sampling requests (rows in their order; None if none of them
        has a live grammar), after the matchers accepted every token recorded so far."""
        return self.finish_fill(self.start_fill(reqs, background=False))

    def start_fill(
        self, reqs: list[Req], background: bool = True, release: GateRelease | None = None
    ) -> Future:
        """The fill job: the matchers accept the recorded tokens, then the bitmask rows of
        `reqs` are filled; on the fill thread (background: xgrammar's batch calls release the
        GIL, so this thread goes on scheduling) or here. finish_fill(future) then starts the
        copy (release: the copy is enqueued already, behind a gate the job opens; then
        finish_gated). Nothing may touch the matchers until finish_fill returns."""
        accepts, self._accepts = self._accepts, []
        args = (release, self._job_for, accepts, reqs)
        live = any(r.matcher is not None and not r.is_finished for r in reqs)
        if not background or not (live or accepts or release):
            future: Future = Future()
            future.set_result(self._released(*args))
            return future
        return self._thread().submit(self._released, *args)

    def start_fill_after(
        self,
        step_reqs: list[Req],
        out_index: list[int],
        tokens: Callable[[], list[int]],
        reqs: list[Req],
        release: GateRelease | None = None,
    ) -> Future:
        """start_fill(reqs) for the step launched after a step whose tokens (`tokens()`, for
        `step_reqs` at `out_index`; it may wait for them to reach the host) the host has not
        processed yet: the job picks that step's grammar tokens itself, so it starts at once.
        The caller then records those tokens with queued=True."""
        earlier, self._accepts = self._accepts, []
        args = (earlier, step_reqs, out_index, tokens, reqs)
        return self._thread().submit(self._released, release, self._job_after, *args)

    def _job_after(self, earlier, step_reqs, out_index, tokens, reqs):
        # NOTE: this runs while the step loop processes the same tokens, so is_finished may read
        # before or after the loop ends a request at this step. Either is fine (an ended request
        # needs no accept and no row) but for a stop token: its accept terminates the matcher,
        # which must then not fill a row, so that is decided from the token itself.
        stop_ids = self._stop_ids
        accepts = list(earlier)
        stopping: set[int] = set()
        for req, idx, token in zip(step_reqs, out_index, tokens()):
            if req.matcher is None or req.is_finished:
                continue
            accepts.append((req, idx, token))
            if token in stop_ids:
                stopping.add(id(req))
        return self._job_for(accepts, reqs, stopping)

    def _job_for(self, accepts: list[Recorded], reqs: list[Req], stopping: set[int] = frozenset()):
        """_job for the sampling `reqs`: the answer gates (engine/thinking.AnswerGate) pass
        the tokens of the answers to the matchers, in order, then tell which rows get a mask."""
        accepts = [a for a in accepts if a[0].answer_gate is None or a[0].answer_gate.fold(a[2])]
        rows = _mask_rows(reqs, stopping)
        return self._job(accepts, reqs, rows)

    def _thread(self) -> ThreadPoolExecutor:
        if self._fill_thread is None:
            self._fill_thread = ThreadPoolExecutor(1, thread_name_prefix="batchrun-bitmask")
        return self._fill_thread

    def _released(self, release: GateRelease | None, job, *args):
        """Run a fill job; for a gated sampling, then set the rows no live grammar constrains
        (a request that ended on this token, or before: its token is dropped anyway) to allow
        all, and open the gate, whatever happened."""
        if release is None:
            return job(*args)
        blank = release.rows  # on an error, no row of garbage reaches the sampler
        try:
            rows, rejected = job(*args)
            live = set(rows)
            blank = [i for i in release.rows if i not in live]
            return rows, rejected
        finally:
            if blank:
                self.backend.allow_all(blank)
            release.open()

    def _job(self, accepts: list[Recorded], reqs: list[Req], rows: list[int]):
        matchers = [reqs[i].matcher for i in rows]
        shards = min(self.backend.fill_shards, len(rows) // MIN_SHARD_ROWS)
        if shards > 1:
            rejected = self._sharded_job(accepts, matchers, rows, shards)
        else:
            rejected = self._accept(accepts)
            if rows:
                self.backend.fill_rows(matchers, rows)
        for i in rows:  # a thinking model's first token may open its thinking instead
            gate = reqs[i].answer_gate
            if gate is not None and gate.opening_token is not None:
                self.backend.allow_token(i, gate.opening_token)
        return rows, rejected

    def _accept(self, accepts: list[Recorded]) -> list[Recorded]:
        """The matchers accept their recorded tokens; returns those rejected."""
        rejected = []
        for batch in _rounds(accepts):
            matchers_now = [req.matcher for req, _, _ in batch]
            ok = self.backend.accept_tokens(matchers_now, [token for *_, token in batch])
            if ok is not None:
                rejected.extend(a for a, accepted in zip(batch, ok) if not accepted)
        return rejected

    def _sharded_job(self, accepts, matchers, rows, shards: int) -> list[Recorded]:
        """_job in `shards` parts at once: part k accepts the tokens of the requests behind its
        slice of the rows, then fills that slice (a row needs only its own matcher's accepts);
        the accepts of requests without a row go to part 0. Part 0 runs on this thread."""
        n = len(rows)
        bounds = [n * k // shards for k in range(shards + 1)]
        part_of = {id(m): k for k in range(shards) for m in matchers[bounds[k] : bounds[k + 1]]}
        parts: list[list[Recorded]] = [[] for _ in range(shards)]
        for a in accepts:
            parts[part_of.get(id(a[0].matcher), 0)].append(a)

        def run(k: int) -> list[Recorded]:
            rejected = self._accept(parts[k])
            lo, hi = bounds[k], bounds[k + 1]
            self.backend.fill_rows(matchers[lo:hi], rows[lo:hi], shard=k)
            return rejected

        pool = self._shard_pool(shards - 1)
        futures = [pool.submit(run, k) for k in range(1, shards)]
        try:
            rejected = run(0)
        finally:
            # NOTE: every part is done before the job returns or raises: the gate opens after
            # it, and an error's allow_all must not race a part still writing its rows
            wait(futures)
        for f in futures:
            rejected.extend(f.result())
        return rejected

    def _shard_pool(self, workers: int) -> ThreadPoolExecutor:
        if self._shard_threads is None or self._shard_workers != workers:
            if self._shard_threads is not None:
                self._shard_threads.shutdown(wait=False)
            self._shard_threads = ThreadPoolExecutor(
                workers, thread_name_prefix="batchrun-bitmask-shard"
            )
            self._shard_workers = workers
        return self._shard_threads

    def finish_gated(self, future: Future) -> list[Recorded]:
        """The rejections of a gated fill job (its mask is on the device already)."""
        return future.result()[1]

    def finish_fill(self, future: Future) -> tuple[TokenMask | None, list[Recorded]]:
        """Wait for the fill job; start the bitmask's copy. Returns the mask and the recorded
        tokens a matcher rejected, (request, output index, token): the caller aborts those."""
        rows, rejected = future.result()
        return (self.backend.upload(rows) if rows else None), rejected


def _mask_rows(reqs: list[Req], stopping: set[int] = frozenset()) -> list[int]:
    """The rows of a step's sampling requests that get a bitmask: those with a live grammar,
    past the thinking (AnswerGate). A request that finished on its previous token samples a
    wasted token (no mask); `stopping`: ids of requests ending on a stop token not yet
    accepted (no mask either)."""
    return [
        i
        for i, r in enumerate(reqs)
        if r.matcher is not None
        and not r.is_finished
        and id(r) not in stopping
        and (r.answer_gate is None or r.answer_gate.constrains_next)
    ]


def _rounds(accepts: list[Recorded]) -> list[list[Recorded]]:
    """Split the recorded tokens so that no matcher appears twice in one batch call (a request
    can hold two when a step without grammar rows came between fill jobs): in order."""
    if len({id(a[0]) for a in accepts}) == len(accepts):
        return [accepts] if accepts else []  # the usual job: one token per request
    rounds: list[list[Recorded]] = []
    seen: list[set[int]] = []
    for a in accepts:
        depth = 0
        key = id(a[0])
        while depth < len(seen) and key in seen[depth]:
            depth += 1
        if depth == len(seen):
            rounds.append([])
            seen.append(set())
        rounds[depth].append(a)
        seen[depth].add(key)
    return rounds
