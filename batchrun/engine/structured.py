"""The engine's side of structured output: requests wait here while their grammar compiles, their
matchers advance with each token the host sees, and a step's bitmask rows are chosen here.

    add_request -> submit(reqs, spec) --compile on a worker--> poll() -> req.matcher set, or
                                                                         req aborted (error)
    process(n)  -> advance(req, token): the matcher accepts it; True when that ends the request
    step n+1    -> fill_mask(sampling reqs) -> TokenMask for the model runner (None: no rows)

The xgrammar side (compiling, the bitmask buffers, the kernels) is in grammar.py.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from batchrun.engine.grammar import GrammarBackend, TokenMask
from batchrun.engine.params import GrammarSpec
from batchrun.engine.request import Req

# when nothing else runs, how long poll() waits for a compile (keeps the caller's loop alive:
# it still feeds requests and sees signals)
IDLE_WAIT_S = 0.05


class StructuredOutput:
    def __init__(
        self, make_backend: Callable[[], GrammarBackend], wait_for_compiles: bool = False
    ) -> None:
        """wait_for_compiles: poll() waits for every compile in flight. Tensor-parallel ranks
        need it: each rank must admit a request at the same step, whatever its compile timing."""
        self._make_backend = make_backend
        self._wait_for_compiles = wait_for_compiles
        self._backend: GrammarBackend | None = None
        self._compiling: list[tuple[Req, Future]] = []
        self._fill_thread: ThreadPoolExecutor | None = None  # bitmask fills (start_fill)

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

    @staticmethod
    def advance(req: Req, token: int) -> bool:
        """Feed a sampled token to the request's matcher; True when that ended the request."""
        if not req.matcher.accept_token(token):
            # the bitmask allowed only tokens the grammar accepts: a bug, not the row's fault
            req.finish_reason = "abort"
            req.error = f"structured output: the grammar rejected sampled token {token}"
            return True
        if req.matcher.is_terminated():
            # the grammar is complete and a stop token (EOS) ended it
            req.finish_reason, req.matched_stop = "stop", token
            return True
        return False

    def fill_mask(self, reqs: list[Req]) -> TokenMask | None:
        """The bitmask of a step's sampling requests (rows in their order); None if none of them
        has a live grammar. Call after the previous step's tokens were advanced."""
        return self.finish_fill(self.start_fill(reqs, background=False))

    def start_fill(self, reqs: list[Req], background: bool = True) -> Future:
        """fill_mask's CPU work, on the fill thread (background) or here; finish_fill(future)
        then starts the copy. The matchers must not advance until finish_fill returns."""
        # a request that finished on the previous token samples a wasted token: no mask
        rows = [i for i, r in enumerate(reqs) if r.matcher is not None and not r.is_finished]
        matchers = [reqs[i].matcher for i in rows]
        if not background or not rows:
            future: Future = Future()
            if rows:
                self.backend.fill_rows(matchers, rows)
            future.set_result(rows)
            return future
        if self._fill_thread is None:
            self._fill_thread = ThreadPoolExecutor(1, thread_name_prefix="batchrun-bitmask")
        return self._fill_thread.submit(self._fill, matchers, rows)

    def _fill(self, matchers: list, rows: list[int]) -> list[int]:
        self.backend.fill_rows(matchers, rows)
        return rows

    def finish_fill(self, future: Future) -> TokenMask | None:
        rows = future.result()
        return self.backend.upload(rows) if rows else None
