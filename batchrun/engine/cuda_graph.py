"""CUDA graphs for decode batches: one graph per batch size, captured largest first into one
shared memory pool, replayed with the real batch copied into static buffers and the rest padded
with a dummy request (dummy req-to-token row whose only KV slot is the pool's dummy slot).

    real batch of n decodes -> smallest captured size bs >= n
    static input_ids / positions [0, n) <- batch, [n, bs) <- 0
    attention buffers via backend.load_graph_inputs (same rule for the padding rows)
    replay; logits rows [0, n) are the batch's

With the Triton kernels on and a backend that exposes its static buffers
(`graph_static_inputs`), all of it is one kernel (kernels/graph_inputs.py), which also resolves
the ids the previous step sampled on the device (placeholders, id < 0), for batches up to
GRAPH_INPUTS_MAX_BS: `resolves_placeholders_of`.

A hybrid model's recurrent states (engine/state_pool.py) are read and written in place, in their
slots: the graph's inputs include the rows' slots (the request rows, the backend's static
req_pool_indices), so a replay advances the live state of the batch's requests, and the padding
rows only the dummy row's. A row whose first step is a decode (a one-token prompt) has its state
cleared before the replay, as an eager step clears it.

Captures run with the garbage collector off (gc_pause.no_gc: a collection inside a capture can
invalidate it).
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from batchrun.attention.base import AttentionInputs
from batchrun.engine.gc_pause import no_gc
from batchrun.engine.precompile import CompilePool
from batchrun.kernels.graph_inputs import load_decode_graph_inputs
from batchrun.models.blocks.model import ForwardBatch

log = logging.getLogger(__name__)

# NOTE: the input kernel serves decode batches up to this size: it pays where a step is short
# enough for six copies and index kernels to show (batch 1, docs/benchmarks.md, "What each
# feature is worth": decode graphs' inputs in one kernel); a 256-row step hides them
GRAPH_INPUTS_MAX_BS = 16


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(80, 257, 16))
    sizes += list(range(288, max_bs + 1, 32))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


class CudaGraphRunner:
    def __init__(
        self,
        model,
        backend,
        req_pool,
        kv_pool,
        max_bs: int,
        device: torch.device,
        token_pool: torch.Tensor | None = None,
        compile_pool: CompilePool | None = None,
        states=None,
    ):
        """token_pool: the sampled tokens' pool, for the one-kernel inputs (None: copies);
        compile_pool: compiles the capture's Triton variants in parallel first; states: a
        hybrid model's StatePool (None: no linear-attention layers)."""
        self.model = model
        self.backend = backend
        self.device = device
        self.batch_sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        # the dummy request: position 0 lives in the dummy slot, so padded rows only ever read
        # and write memory no real request owns
        req_pool.table[req_pool.dummy_row, 0] = kv_pool.dummy_slot
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_time = 0.0
        self.states = states
        backend.init_graph_buffers(self.max_bs)
        static = backend.graph_static_inputs()
        if states is not None and static is None:
            raise ValueError(
                "a hybrid model's decode graphs read the rows' state slots from the attention "
                "backend's static inputs (graph_static_inputs), and this backend has none; use "
                "attention 'triton' or cuda_graph_max_bs 0"
            )
        # [max_bs + 1]: 0, 1, .., max_bs, the cu_seqlens of a decode batch
        self.state_cu_seqlens = torch.arange(self.max_bs + 1, device=device)
        self._capture(None if static is None else static[0][0], compile_pool)
        self.token_pool = token_pool
        self._one_kernel_inputs = None  # (static buffers, padding row, padding slot)
        if token_pool is not None and static is not None:
            buffers, pad_row, pad_slot = static
            dst = (self.input_ids, self.positions, *buffers)
            self._one_kernel_inputs = (dst, pad_row, pad_slot)
            self._compile_input_kernel(pad_row, pad_slot)

    def _compile_input_kernel(self, pad_row: int, pad_slot: int) -> None:
        """Compile kernels/graph_inputs.py's one variant now, on scratch tensors: not at the
        first replay, which may be inside a timed run."""
        scratch = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(10)]
        load_decode_graph_inputs(scratch[:5], scratch[5:], self.token_pool, 1, 1, pad_row, pad_slot)

    def _prepare(self, bs: int, rows: torch.Tensor | None) -> ForwardBatch:
        """The backend (and the states) switched to the static buffers [:bs]; host work only."""
        self.backend.prepare_graph(bs)
        if self.states is not None:
            self.states.prepare_graph(rows[:bs], self.state_cu_seqlens[: bs + 1])
        return ForwardBatch(self.input_ids[:bs], self.positions[:bs], None)

    def _dry_pass(self, compile_pool: CompilePool, rows, stream) -> list[tuple[str, str, str]]:
        """The Triton variants the capture's forwards would compile (none launches); a pass
        that stops early gives what it recorded, and the capture compiles the rest."""
        variants: list[tuple[str, str, str]] = []
        try:
            with compile_pool.recording() as recorded, torch.cuda.stream(stream):
                variants = recorded
                for bs in reversed(self.batch_sizes):
                    self.model(self._prepare(bs, rows), self.backend)
        except Exception as e:  # noqa: BLE001 (the capture below compiles what is missing)
            log.warning("the start-up compile pool's dry pass stopped: %s: %s", type(e).__name__, e)
        return variants

    def _capture(self, rows: torch.Tensor | None, compile_pool: CompilePool | None) -> None:
        """rows: the backend's static request rows [max_bs] (the state slots)."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if compile_pool is not None:  # a dry pass over every size, then the compiles at once
            compile_pool.compile(self._dry_pass(compile_pool, rows, stream))
        with no_gc():
            for bs in reversed(self.batch_sizes):
                batch = self._prepare(bs, rows)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self.model(batch, self.backend)  # warm up: compiles, sizes workspaces
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        out = self.model(batch, self.backend)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                self.graphs[bs], self.outputs[bs] = graph, out
        torch.cuda.synchronize(self.device)
        self.capture_time = time.perf_counter() - t0
        log.info("captured %d CUDA graphs in %.1f s", len(self.graphs), self.capture_time)

    def can_run(self, attn: AttentionInputs) -> bool:
        return attn.is_decode and attn.batch_size <= self.max_bs

    def resolves_placeholders_of(self, attn: AttentionInputs) -> bool:
        """Whether replay(..., attn) takes ids with placeholders (< 0: token_pool[the request's
        row]): it loads this batch's inputs in one kernel."""
        return self._one_kernel_inputs is not None and attn.batch_size <= GRAPH_INPUTS_MAX_BS

    def replay(self, input_ids, positions, attn: AttentionInputs) -> torch.Tensor:
        n = attn.batch_size
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        if self.states is not None:
            self.states.clear_fresh(attn)
        if self.resolves_placeholders_of(attn):
            dst, pad_row, pad_slot = self._one_kernel_inputs
            src = (input_ids, positions, attn.req_pool_indices, attn.seq_lens, attn.out_cache_loc)
            load_decode_graph_inputs(src, dst, self.token_pool, n, bs, pad_row, pad_slot)
        else:
            self.input_ids[:n].copy_(input_ids, non_blocking=True)
            self.positions[:n].copy_(positions, non_blocking=True)
            if bs > n:
                self.input_ids[n:bs].zero_()
                self.positions[n:bs].zero_()
            self.backend.load_graph_inputs(attn, bs)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
