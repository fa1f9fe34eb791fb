"""The device side of a step: turns a ScheduledBatch into tensors, runs the model and the sampler.

    handle = runner.launch(batch, sampling)      # the forward and the sampling, enqueued
    out = runner.wait(handle)                    # the one sync: the sampled ids on the host

A step whose sampling needs its grammar rows' token bitmask, with no host gate to hold the
device until the host has filled it, launches with `defer=True`: its handle keeps the logits
until `sample_pending(handle, mask, grammar)` enqueues the sampling.

All host-to-device copies go through pinned buffers with non_blocking=True on CUDA; the only
device-to-host transfer is the sampled tokens (and logprobs when asked).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch

from batchrun.attention import AttentionInputs, create_backend
from batchrun.attention.windowed import WindowedAttentionBackend
from batchrun.config import EngineConfig, KernelPlan
from batchrun.engine.grammar import GrammarBackend, TokenMask
from batchrun.engine.kv_pool import KVPool, ReqToTokenPool
from batchrun.engine.kv_sizing import kv_slots
from batchrun.engine.piecewise_graph import MAX_TOKENS, PiecewiseGraphRunner
from batchrun.engine.precompile import CompilePool
from batchrun.engine.sampler import PenaltyState, SampleOutput, Sampler, SamplingBatch
from batchrun.engine.scheduler import ScheduledBatch
from batchrun.engine.staging import PinnedStaging
from batchrun.engine.state_snapshots import StateSnapshots, num_snapshots
from batchrun.engine.thinking import apply_forced, forced_logprobs
from batchrun.engine.window_pool import (
    WindowSlots,
    max_window,
    sliding_kv_indices,
    split_shapes,
    uses_window_pool,
)
from batchrun.models import fused_decode
from batchrun.models.blocks.model import ForwardBatch
from batchrun.models.config import ModelConfig
from batchrun.models.loader import load_model
from batchrun.parallel.state import tp_group_for
from batchrun.quant.kv_cache import kv_storage_dtype, layer_scales

try:
    from batchrun.kernels.gemv import split_counters
except ImportError:  # no Triton (CPU-only installs): KernelPlan.triton_ops is off
    split_counters = None

log = logging.getLogger(__name__)


class StepOutput(NamedTuple):
    next_token_ids: list[int]  # one per sampling request, in batch order
    logprobs: list[float] | None
    top_logprobs: list[tuple[list[int], list[float]]] | None


class PendingSample(NamedTuple):
    """A launched forward's logits waiting for their sampling (launch(..., defer=True))."""

    logits: torch.Tensor  # [S, V] in the model's dtype, on the device
    sample_rows: torch.Tensor  # [S] int64: the sampling requests' rows
    sampling: SamplingBatch


class _Staged(NamedTuple):
    """A step's inputs on their way to the device (ModelRunner._stage)."""

    input_ids: torch.Tensor  # [T]; placeholders (< 0) where the id is still in token_pool
    positions: torch.Tensor
    logits_idx: torch.Tensor
    attn: AttentionInputs
    sample_rows: torch.Tensor
    ph_pos: torch.Tensor  # token positions whose id comes from token_pool[ph_rows]
    ph_rows: torch.Tensor
    table_writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # queued req-to-token writes
    window_writes: tuple[torch.Tensor, ...]  # the window pool's queued writes (or none)
    has_placeholders: bool


class _Forward(NamedTuple):
    """A launched forward (ModelRunner._run_forward)."""

    logits: torch.Tensor  # [S, V] in the model's dtype, on the device
    sample_rows: torch.Tensor  # [S] int64: the sampling requests' rows
    forward_start: object | None
    forward_end: object | None


class StepHandle(NamedTuple):
    """A launched step: its device->host copies are in flight until `event` completes. A step
    launched with defer=True has no results yet: `pending` holds its logits."""

    next_ids_cpu: torch.Tensor | None  # [S] int64 (pinned on CUDA)
    logprobs_cpu: torch.Tensor | None
    top_ids_cpu: torch.Tensor | None
    top_vals_cpu: torch.Tensor | None
    event: object | None  # torch.cuda.Event, None on CPU
    forward_start: object | None  # CUDA events bracketing the forward, for GPU occupancy
    forward_end: object | None
    pending: PendingSample | None = None


def resolve_dtype(name: str, device: torch.device, model_cfg: ModelConfig) -> torch.dtype:
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return getattr(torch, name)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device 'cuda' was asked for (EngineConfig.device, the device= argument of the "
            "Python API), but CUDA is not available here; use device='cpu' (or 'auto')"
        )
    return torch.device(name)


class ModelRunner:
    """config: resolved (sizes, overlap); kernels: the plan (engine/kernel_choice.py). The
    runner's `kernels` is that plan as the model made it (decode_norms "fold-all" runs "off"
    when its folded weights do not fit: models/fused_decode.py)."""

    def __init__(
        self,
        config: EngineConfig,
        kernels: KernelPlan,
        model_cfg: ModelConfig,
        model_dir,
        context_len: int,
    ):
        assert kernels.is_resolved, "resolve the kernel plan first (kernel_choice)"
        self.config = config
        self.model_cfg = model_cfg
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, model_cfg)
        self.context_len = context_len
        # the start-up compile pool imports while the weights load (engine/precompile.py)
        compile_pool = CompilePool.start(kernels.compile_workers)
        self.model = load_model(
            model_dir,
            model_cfg,
            config.load_format,
            self.dtype,
            self.device,
            max_positions=context_len,
            seed=config.seed,
            tp=tp_group_for(config),  # the no-op group at tp_size 1
            kernels=kernels,
            dummy_init=config.dummy_init,
        )
        self.kernels = kernels = replace(kernels, decode_norms=fused_decode.prepare(self.model))
        # a hybrid model's recurrent states, one slot a request row (engine/state_pool.py); its
        # decode graphs take the rows' slots as inputs (engine/cuda_graph.py); NOTE: no
        # piecewise graphs: a prefill step's linear layers size their launches on the host
        self.states = getattr(self.model, "state_pool", None)
        if self.states is not None:
            kernels = replace(kernels, piecewise_graphs=False)
            self.kernels = kernels
        log.info("kernels: %s", kernels.describe())
        if kernels.decode_gemv == "triton":
            split_counters(self.device)  # NOTE: allocated before any graph capture
        # the KV pool's element type: the compute dtype, or float8_e4m3fn with the checkpoint's
        # per-layer scales (batchrun/quant/kv_cache.py)
        self.kv_dtype = kv_storage_dtype(config.kv_cache_dtype, self.dtype)
        kv_fp8 = self.kv_dtype != self.dtype
        # the radix cache's state snapshots of a hybrid (engine/state_snapshots.py)
        self.snapshots = None
        if self.states is not None and config.enable_radix_cache:
            self.snapshots = StateSnapshots(self.states, num_snapshots(config.max_running))
        shapes = self.model.kv_shapes  # this rank's KV heads under tensor parallelism
        # the sliding layers' own pool of their windows (engine/window_pool.py); None: off
        self.window = None
        self.window_pool = None
        self.sliding = ()
        window_shapes = ()
        if uses_window_pool(model_cfg, self.states is not None):
            self.sliding = sliding_kv_indices(model_cfg)
            shapes, window_shapes = split_shapes(shapes, self.sliding)
        state_bytes = 0  # a hybrid's state rows and their snapshots, before the KV pools
        if self.states is not None:
            rows = config.max_running + 1
            state_bytes = self.states.bytes_per_row(config.linear_state_dtype) * rows
        if self.snapshots is not None:
            state_bytes += self.snapshots.bytes(config.linear_state_dtype)
        self.num_slots, num_window_slots = kv_slots(
            config, model_cfg, shapes, window_shapes, device=self.device, dtype=self.dtype,
            prefill_budget=self._prefill_budget, state_bytes=state_bytes,
        )  # fmt: skip
        scales = layer_scales(self.model) if kv_fp8 else None
        self.kv_pool = KVPool(
            len(shapes),
            self.num_slots,
            self.model.num_kv_heads,
            model_cfg.head_dim,
            self.kv_dtype,
            self.device,
            kernels,
            scales,
            shapes=shapes,
        )
        log.info("KV cache: %d tokens of %s", self.num_slots, str(self.kv_dtype).split(".")[-1])
        self.req_pool = ReqToTokenPool(config.max_running, context_len, self.device)
        if num_window_slots:
            self.window_pool = KVPool(
                len(shapes), num_window_slots, self.model.num_kv_heads, model_cfg.head_dim,
                self.kv_dtype, self.device, kernels, scales, shapes=window_shapes,
            )  # fmt: skip
            self.window = WindowSlots(
                num_window_slots,
                max_window(model_cfg),
                config.max_running,
                context_len,
                self.device,
                self._prefill_budget,
            )
            log.info(
                "KV cache of the sliding layers: %d tokens (the windows of %d requests)",
                num_window_slots,
                self.window.max_requests,
            )
        if self.states is not None:
            self.states.allocate(config.max_running + 1, self.device, config.linear_state_dtype)
        if self.snapshots is not None:
            self.snapshots.allocate()
        self.backend = create_backend(kernels, self.kv_pool, self.req_pool.table)
        full_backend = self.backend
        if self.window is not None:
            self.backend = WindowedAttentionBackend(
                full_backend,
                create_backend(kernels, self.window_pool, self.window.req_pool.table),
                self.sliding,
            )
        self.sampler = Sampler(kernels)
        self.penalties = PenaltyState(config.max_running + 1, model_cfg.vocab_size, self.device)
        self._pin = self.device.type == "cuda"
        # NOTE: the engine runs on the stream current at start-up; recording events on a stream
        # given by hand spares torch's current-stream lookup (Python work) per event
        self.stream = torch.cuda.current_stream(self.device) if self._pin else None
        self.staging = PinnedStaging(self.device, self.stream)  # the step's host-to-device copies
        # the latest sampled token of each request row, kept on the device so that the next
        # step can start before the host has seen it (overlap scheduling)
        self.token_pool = torch.zeros(config.max_running + 1, dtype=torch.int64, device=self.device)
        self.forward_time = 0.0  # GPU time inside forwards (CUDA events), seconds
        # the forwards' (start, end) events not yet counted, oldest first: a step of prefill
        # chunks alone has no host copy to wait for, so its forward may still run at wait()
        self._timed: collections.deque = collections.deque()
        self.graphs = None  # CUDA-graph runner for decode batches
        if kernels.cuda_graph_max_bs > 0 and hasattr(full_backend, "init_graph_buffers"):
            from batchrun.engine.cuda_graph import CudaGraphRunner  # imports Triton: CUDA only

            self.graphs = CudaGraphRunner(
                self.model,
                self.backend,
                self.req_pool,
                self.kv_pool,
                min(kernels.cuda_graph_max_bs, config.max_running),
                self.device,
                # the graphs' inputs in one Triton kernel (kernels/graph_inputs.py)
                token_pool=self.token_pool if kernels.triton_ops else None,
                compile_pool=compile_pool,
                states=self.states,
            )
        if compile_pool is not None:
            compile_pool.close()
        self.piecewise = None  # piecewise graphs for the other steps
        if kernels.piecewise_graphs:
            self.piecewise = PiecewiseGraphRunner(
                self.model,
                self.backend,
                min(config.chunked_prefill_size + config.max_running, MAX_TOKENS),
                self.device,
            )

    @property
    def _prefill_budget(self) -> int:
        return self.config.chunked_prefill_size or self.context_len

    def _to_device(self, values, dtype=torch.int64) -> torch.Tensor:
        t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        if self.device.type == "cpu":
            return t
        if self._pin:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def _pack_to_device(self, *arrays) -> list[torch.Tensor]:
        """Several host int arrays -> device views, through one pinned buffer and one copy.
        Each view starts 16-byte aligned (an odd-length array is followed by a pad)."""
        # NOTE: Triton specializes a kernel on whether each pointer is 16-byte aligned: views at
        # offsets that vary with the batch's sizes made new variants appear (and compile, ~0.5 s
        # each) in the middle of a run
        sizes: list[int] = []
        flat: list[int] = []
        for a in arrays:
            flat.extend(a.tolist() if isinstance(a, torch.Tensor) else a)
            sizes += (len(a), len(a) % 2)
            if len(a) % 2:
                flat.append(0)
        packed = self.staging.to_device(flat, torch.int64)
        return list(packed.split(sizes)[::2])

    def launch(
        self,
        batch: ScheduledBatch,
        sampling: SamplingBatch | None,
        mask: Callable[[], tuple[TokenMask, GrammarBackend]] | None = None,
        defer: bool = False,
    ) -> StepHandle:
        """Enqueue a step: its forward, then its sampling (none for a step of prefill chunks
        only) and the copy of the sampled ids to the host; no sync. `mask`, called once the
        forward is enqueued, enqueues the grammar rows' token bitmask (behind a host gate) and
        returns it with its backend, to mask the logits before sampling. With `defer` the
        sampling waits for sample_pending (the handle's `pending` holds the logits)."""
        fwd = self._run_forward(self._stage(batch))
        if sampling is None or defer:
            pending = None
            if sampling is not None:
                pending = PendingSample(fwd.logits, fwd.sample_rows, sampling)
            events = (fwd.forward_start, fwd.forward_end)
            return StepHandle(None, None, None, None, None, *events, pending)
        token_mask, grammar = (None, None) if mask is None else mask()
        return self._sample(fwd, sampling, token_mask, grammar)

    def sample_pending(
        self, handle: StepHandle, mask: TokenMask | None, grammar: GrammarBackend | None
    ) -> StepHandle:
        """Enqueue the sampling of a step launched with defer=True (its logits masked first by
        the grammar rows' token bitmask, if any)."""
        p = handle.pending
        fwd = _Forward(p.logits, p.sample_rows, handle.forward_start, handle.forward_end)
        return self._sample(fwd, p.sampling, mask, grammar)

    def _stage(self, batch: ScheduledBatch) -> _Staged:
        """A step's forward, host half: the step's inputs, packed and on their way to the
        device (nothing staged reads the device state of earlier steps)."""
        seq_lens = batch.seq_lens
        rows = [r.row for r in batch.reqs]
        logits_indices: list[int] = []
        sample_rows: list[int] = []
        ph_positions: list[int] = []  # tokens whose id is still on the device (overlap)
        ph_rows: list[int] = []
        end = 0
        for req, n, sampled in zip(batch.reqs, batch.extend_lens, batch.sample_mask):
            if batch.input_ids[end] < 0:
                ph_positions.append(end)
                ph_rows.append(req.row)
            end += n
            if sampled:
                logits_indices.append(end - 1)
                sample_rows.append(req.row)
        table_rows, table_cols, table_slots = self.req_pool.take_pending()
        window = ()  # the window pool's slots of the new tokens and its queued table writes
        if self.window is not None:
            locs = self.window.locs(rows, batch.prefix_lens, batch.extend_lens)
            window = (locs, *self.window.req_pool.take_pending())
        (input_ids, positions, out_loc, logits_idx, rows_t, seq_t, ext_t, ph_pos, ph_row,
         sample_rows_t, t_rows, t_cols, t_slots, *window) = self._pack_to_device(
            batch.input_ids, batch.positions, batch.out_cache_loc, logits_indices, rows,
            seq_lens, batch.extend_lens, ph_positions, ph_rows, sample_rows,
            table_rows, table_cols, table_slots, *window,
        )  # fmt: skip
        attn = AttentionInputs(
            req_pool_indices=rows_t,
            seq_lens=seq_t,
            extend_lens=ext_t,
            out_cache_loc=out_loc,
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=batch.extend_lens,
            window_out_cache_loc=window[0] if window else None,
        )
        return _Staged(
            input_ids, positions, logits_idx, attn, sample_rows_t, ph_pos, ph_row,
            (t_rows, t_cols, t_slots), tuple(window[1:]), bool(ph_positions),
        )  # fmt: skip

    def _run_forward(self, staged: _Staged) -> _Forward:
        """A step's forward, device half: table writes, placeholder ids, the forward."""
        # queued request-to-token writes (admissions, new slots) land before attention reads
        self.req_pool.apply(*staged.table_writes)
        if staged.window_writes:
            self.window.req_pool.apply(*staged.window_writes)
        input_ids = staged.input_ids
        if staged.has_placeholders and not self._graph_resolves_placeholders(staged.attn):
            # the previous step sampled these tokens; they never left the device
            input_ids[staged.ph_pos] = self.token_pool[staged.ph_rows]
        is_cuda = self.device.type == "cuda"
        start_ev = end_ev = None
        if is_cuda:
            start_ev = torch.cuda.Event(enable_timing=True)
            end_ev = torch.cuda.Event(enable_timing=True)
            start_ev.record(self.stream)
        t0 = time.perf_counter()
        logits = self._forward(input_ids, staged.positions, staged.logits_idx, staged.attn)
        if is_cuda:
            end_ev.record(self.stream)
        else:
            self.forward_time += time.perf_counter() - t0
        return _Forward(logits, staged.sample_rows, start_ev, end_ev)

    def _sample(
        self,
        fwd: _Forward,
        sampling: SamplingBatch,
        mask: TokenMask | None,
        grammar: GrammarBackend | None,
    ) -> StepHandle:
        """Enqueue sampling from a launched forward's logits (masked first by the grammar rows'
        token bitmask, if any) and the copy of the results to the host; no sync."""
        logits = fwd.logits
        out = None
        if mask is not None and sampling.is_plain_greedy:
            next_ids = grammar.greedy(logits, mask)  # the mask and the argmax in one pass
            if next_ids is not None:
                out = SampleOutput(next_ids, None, None, None)
        if out is None:
            if mask is not None:
                grammar.apply(logits, mask)  # in place: the logits are this step's own
            out = self.sampler(logits, sampling, self.penalties)
        if sampling.forced is not None:
            prev = self.token_pool[fwd.sample_rows]
            next_ids = apply_forced(out.next_token_ids, sampling.forced, prev)
            out = out._replace(next_token_ids=next_ids)
            if out.logprobs is not None:
                lp = forced_logprobs(logits, sampling.forced, next_ids, out.logprobs)
                out = out._replace(logprobs=lp)
        if sampling.has_penalties:
            self.penalties.update(sampling.rows, out.next_token_ids)
        self.token_pool[fwd.sample_rows] = out.next_token_ids
        tensors = [out.next_token_ids, out.logprobs, out.top_logprob_ids, out.top_logprob_vals]
        if self.device.type != "cuda":
            return StepHandle(*tensors, None, None, None)
        host = [None if t is None else t.to("cpu", non_blocking=True) for t in tensors]
        event = torch.cuda.Event()
        event.record(self.stream)
        return StepHandle(*host, event, fwd.forward_start, fwd.forward_end)

    def _graph_resolves_placeholders(self, attn: AttentionInputs) -> bool:
        """Whether this step replays a decode graph whose input kernel reads the placeholder ids
        from the token pool itself (then _run_forward leaves them)."""
        # NOTE: the batch-size test first: can_run scans every request's extend length
        graphs = self.graphs
        return graphs is not None and graphs.resolves_placeholders_of(attn) and graphs.can_run(attn)

    def _forward(self, input_ids, positions, logits_idx, attn: AttentionInputs) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(attn):
            return self.graphs.replay(input_ids, positions, attn)
        self.backend.prepare(attn)
        if self.states is not None:
            self.states.prepare(attn)
        if self.piecewise is not None and self.piecewise.can_run(input_ids.shape[0]):
            return self.piecewise.run(input_ids, positions, logits_idx)
        fwd = ForwardBatch(input_ids=input_ids, positions=positions, logits_indices=logits_idx)
        return self.model(fwd, self.backend)  # [S, V] in the model's dtype

    def host_tokens(self, handle: StepHandle) -> list[int]:
        """The step's sampled ids once they are on the host (blocks until then; the GIL is
        released meanwhile). Safe from another thread; wait() still settles the step."""
        if handle.event is not None:
            handle.event.synchronize()
        return [] if handle.next_ids_cpu is None else handle.next_ids_cpu.tolist()

    def _settle_forward_times(self) -> None:
        """Add the forwards that have completed to forward_time, in order, without blocking."""
        while self._timed and self._timed[0][1].query():
            start, end = self._timed.popleft()
            self.forward_time += start.elapsed_time(end) / 1e3

    def wait(self, handle: StepHandle) -> StepOutput:
        """Block until the step's results are on the host (the one sync of a step)."""
        if handle.event is not None:
            handle.event.synchronize()
        if handle.forward_end is not None:
            self._timed.append((handle.forward_start, handle.forward_end))
        self._settle_forward_times()
        if handle.next_ids_cpu is None:
            return StepOutput([], None, None)
        logprobs = handle.logprobs_cpu.tolist() if handle.logprobs_cpu is not None else None
        top = None
        if handle.top_ids_cpu is not None:
            top = list(zip(handle.top_ids_cpu.tolist(), handle.top_vals_cpu.tolist()))
        return StepOutput(handle.next_ids_cpu.tolist(), logprobs, top)

    @torch.inference_mode()
    def all_logits(self, input_ids: list[int], slots: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits [T, V] of one sequence, outside the scheduler (tests, scoring).
        `slots`: free KV slots (at least len(input_ids)) lent by the caller."""
        n = len(input_ids)
        row = self.req_pool.dummy_row
        slots = slots[:n]
        self.req_pool.table[row, :n] = slots.to(self.device, self.req_pool.table.dtype)
        window_slots = None
        if self.window is not None:  # the sliding layers' KV of every position, lent too
            window_slots = self.window.allocate(n)
            if window_slots is None:
                raise ValueError(f"{n} tokens do not fit the sliding layers' window pool")
            self.window.req_pool.table[row, :n] = window_slots.to(self.device, torch.int32)
        attn = AttentionInputs(
            req_pool_indices=self._to_device([row]),
            seq_lens=self._to_device([n]),
            extend_lens=self._to_device([n]),
            out_cache_loc=self._to_device(slots),
            seq_lens_cpu=(n,),
            extend_lens_cpu=(n,),
            window_out_cache_loc=None if window_slots is None else self._to_device(window_slots),
        )
        try:
            self.backend.prepare(attn)
            if self.states is not None:
                self.states.prepare(attn)
            fwd = ForwardBatch(self._to_device(input_ids), self._to_device(list(range(n))), None)
            return self.model(fwd, self.backend).float()
        finally:
            if window_slots is not None:
                self.window.req_pool.table[row, :n] = self.window.dummy_slot
                self.window.drop(window_slots)
