"""The device side of a step: turns a ScheduledBatch into tensors, runs the model and the sampler.

All host-to-device copies go through pinned buffers with non_blocking=True on CUDA; the only
device-to-host transfer is the sampled tokens (and logprobs when asked).
"""

from __future__ import annotations

import logging
import os
import time
from typing import NamedTuple

import torch

from batchrun.attention import AttentionInputs, create_backend
from batchrun.engine.config import EngineConfig, is_large
from batchrun.engine.grammar import GrammarBackend, TokenMask
from batchrun.engine.kv_pool import KVPool, ReqToTokenPool
from batchrun.engine.sampler import PenaltyState, SampleOutput, Sampler, SamplingBatch
from batchrun.engine.scheduler import ScheduledBatch
from batchrun.engine.staging import PinnedStaging
from batchrun.models.config import ModelConfig
from batchrun.models.layers import use_fused_kernels
from batchrun.models.llama import ForwardBatch
from batchrun.models.loader import load_model
from batchrun.parallel.state import tp_group_for

log = logging.getLogger(__name__)


class StepOutput(NamedTuple):
    next_token_ids: list[int]  # one per sampling request, in batch order
    logprobs: list[float] | None
    top_logprobs: list[tuple[list[int], list[float]]] | None


class ForwardHandle(NamedTuple):
    """A launched forward whose logits wait for their sampler (a step with grammar requests
    samples only once the host has filled the token bitmask)."""

    logits: torch.Tensor  # [S, V] fp32, on the device
    sample_rows: torch.Tensor  # [S] int64: the sampling requests' rows
    forward_start: object | None
    forward_end: object | None


class StagedForward(NamedTuple):
    """A step's inputs on their way to the device (ModelRunner.stage_forward)."""

    input_ids: torch.Tensor  # [T]; placeholders (< 0) where the id is still in token_pool
    positions: torch.Tensor
    logits_idx: torch.Tensor
    attn: AttentionInputs
    sample_rows: torch.Tensor
    ph_pos: torch.Tensor  # token positions whose id comes from token_pool[ph_rows]
    ph_rows: torch.Tensor
    table_writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # queued req-to-token writes
    has_placeholders: bool


class StepHandle(NamedTuple):
    """A launched step: its device->host copies are in flight until `event` completes."""

    next_ids_cpu: torch.Tensor | None  # [S] int64 (pinned on CUDA)
    logprobs_cpu: torch.Tensor | None
    top_ids_cpu: torch.Tensor | None
    top_vals_cpu: torch.Tensor | None
    event: object | None  # torch.cuda.Event, None on CPU
    forward_start: object | None  # CUDA events bracketing the forward, for GPU occupancy
    forward_end: object | None


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
        raise ValueError("--device cuda was asked for, but CUDA is not available; use --device cpu")
    return torch.device(name)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, model_dir, context_len: int):
        self.config = config
        self.model_cfg = model_cfg
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, model_cfg)
        self.context_len = context_len
        self.model = load_model(
            model_dir,
            model_cfg,
            config.load_format,
            self.dtype,
            self.device,
            max_positions=context_len,
            seed=config.seed,
            tp=tp_group_for(config),  # the no-op group at tp_size 1
        )
        self.model.set_decode_gemv("all" if self._use_decode_gemv() else None)
        if self.device.type == "cuda" and use_fused_kernels(torch.empty(0, device=self.device)):
            from batchrun.kernels.gemv import split_counters

            # NOTE: before any graph capture (BATCHRUN_GEMV may turn gemv on whatever the mode)
            split_counters(self.device)
        self.num_slots = self._kv_slots()
        self.kv_pool = KVPool(
            model_cfg.num_layers,
            self.num_slots,
            self.model.num_kv_heads,  # this rank's KV heads under tensor parallelism
            model_cfg.head_dim,
            self.dtype,
            self.device,
        )
        self.req_pool = ReqToTokenPool(config.max_running, context_len, self.device)
        self.backend = create_backend(
            config.attention_backend, self.kv_pool, self.req_pool.table, self.device
        )
        self.sampler = Sampler()
        self.penalties = PenaltyState(config.max_running + 1, model_cfg.vocab_size, self.device)
        self._pin = self.device.type == "cuda"
        # NOTE: the engine runs on the stream current at start-up; recording events on a stream
        # given by hand spares torch's current-stream lookup (Python, several µs) per event
        self.stream = torch.cuda.current_stream(self.device) if self._pin else None
        self.staging = PinnedStaging(self.device, self.stream)  # the step's host-to-device copies
        # the latest sampled token of each request row, kept on the device so that the next
        # step can start before the host has seen it (overlap scheduling)
        self.token_pool = torch.zeros(config.max_running + 1, dtype=torch.int64, device=self.device)
        self.forward_time = 0.0  # GPU time inside forwards (CUDA events), seconds
        self.graphs = None  # CUDA-graph runner for decode batches
        if (
            self.device.type == "cuda"
            and config.cuda_graph_max_bs > 0
            and hasattr(self.backend, "init_graph_buffers")
        ):
            from batchrun.engine.cuda_graph import CudaGraphRunner

            self.graphs = CudaGraphRunner(
                self.model,
                self.backend,
                self.req_pool,
                self.kv_pool,
                min(config.cuda_graph_max_bs, config.max_running),
                self.device,
                # the graphs' inputs in one Triton kernel (kernels/graph_inputs.py), where the
                # Triton kernels are on
                token_pool=self.token_pool if use_fused_kernels(self.token_pool) else None,
            )
        self.piecewise = None  # piecewise graphs for the other steps
        if self._use_piecewise():
            from batchrun.engine.piecewise_graph import MAX_TOKENS, PiecewiseGraphRunner

            self.piecewise = PiecewiseGraphRunner(
                self.model,
                self.backend,
                min(config.chunked_prefill_size + config.max_running, MAX_TOKENS),
                self.device,
            )

    def _use_decode_gemv(self) -> bool:
        """config.decode_gemv, resolved: see EngineConfig (BATCHRUN_GEMV still overrides it)."""
        mode = self.config.decode_gemv
        if mode != "auto" or self.device.type != "cuda":
            return mode == "triton"
        from batchrun.kernels.pdl import PDL_ENV, device_supports_pdl

        # NOTE: the Triton matmuls pay only with PDL: without it they lost to cuBLAS (W3
        # llama-1b 1.28 against 1.16 ms, eighth session), so BATCHRUN_PDL=0 means cuBLAS too
        return device_supports_pdl(self.device) and os.environ.get(PDL_ENV) != "0"

    def _use_piecewise(self) -> bool:
        """config.piecewise_cuda_graph, where it can run: CUDA, a token budget per step (a
        chunked prefill size) and a model built of pre_attention / post_attention halves."""
        cfg = self.config
        if (
            self.device.type != "cuda"
            or not isinstance(cfg.chunked_prefill_size, int)
            or not hasattr(self.model.layers[0], "pre_attention")
        ):
            return False
        if cfg.piecewise_cuda_graph is not None:
            return cfg.piecewise_cuda_graph
        # NOTE: on by default only where the host is the bottleneck: a small model's mixed steps
        # (a large one's GPU time hides their launches, and the padding to a captured size costs)
        return cfg.cuda_graph_max_bs > 0 and not is_large(self.model_cfg)

    def _kv_slots(self) -> int:
        cfg, page = self.config, self.config.page_size
        if cfg.kv_budget is not None:
            return max(page, cfg.kv_budget // page * page)
        per_token = KVPool.bytes_per_token(
            self.model_cfg.num_layers,
            self.model.num_kv_heads,
            self.model_cfg.head_dim,
            self.dtype,
        )
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * cfg.kv_memory_fraction)
        else:
            import psutil

            # NOTE: a CPU run is a demo or a test: an eighth of available memory, at most 32k
            # tokens (the pool is zeroed up front, so a huge one costs seconds at start-up)
            budget = min(psutil.virtual_memory().available // 8, per_token << 15)
        slots = max(budget // per_token, page)
        return slots // page * page

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

    def sample_or_skip(self, fwd: ForwardHandle, sampling: SamplingBatch | None) -> StepHandle:
        """launch_sample, or for a step that samples nothing (prefill chunks only) a handle
        with no results."""
        if sampling is None:
            return StepHandle(None, None, None, None, None, fwd.forward_start, fwd.forward_end)
        return self.launch_sample(fwd, sampling)

    def stage_forward(self, batch: ScheduledBatch) -> StagedForward:
        """A step's forward, host half: the step's inputs, packed and on their way to the
        device; run_forward then enqueues the forward, whose logits stay on the device for
        launch_sample (or sample_or_skip). Nothing staged reads the device state of earlier
        steps, so a caller may enqueue other work (the previous step's sampling) in between."""
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
        (input_ids, positions, out_loc, logits_idx, rows_t, seq_t, ext_t, ph_pos, ph_row,
         sample_rows_t, t_rows, t_cols, t_slots) = self._pack_to_device(
            batch.input_ids, batch.positions, batch.out_cache_loc, logits_indices, rows,
            seq_lens, batch.extend_lens, ph_positions, ph_rows, sample_rows,
            table_rows, table_cols, table_slots,
        )  # fmt: skip
        attn = AttentionInputs(
            req_pool_indices=rows_t,
            seq_lens=seq_t,
            extend_lens=ext_t,
            out_cache_loc=out_loc,
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=batch.extend_lens,
        )
        return StagedForward(
            input_ids, positions, logits_idx, attn, sample_rows_t, ph_pos, ph_row,
            (t_rows, t_cols, t_slots), bool(ph_positions),
        )  # fmt: skip

    def run_forward(self, staged: StagedForward) -> ForwardHandle:
        """A step's forward, device half: table writes, placeholder ids, the forward."""
        # queued request-to-token writes (admissions, new slots) land before attention reads
        self.req_pool.apply(*staged.table_writes)
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
        return ForwardHandle(logits, staged.sample_rows, start_ev, end_ev)

    def launch_sample(
        self,
        fwd: ForwardHandle,
        sampling: SamplingBatch,
        mask: TokenMask | None = None,
        grammar: GrammarBackend | None = None,
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
        from the token pool itself (then run_forward leaves them)."""
        # NOTE: the batch-size test first: can_run scans every request's extend length
        graphs = self.graphs
        return graphs is not None and graphs.resolves_placeholders_of(attn) and graphs.can_run(attn)

    def _forward(self, input_ids, positions, logits_idx, attn: AttentionInputs) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(attn):
            return self.graphs.replay(input_ids, positions, attn)
        self.backend.prepare(attn)
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

    def wait(self, handle: StepHandle) -> StepOutput:
        """Block until the step's results are on the host (the one sync of a step)."""
        if handle.event is not None:
            handle.event.synchronize()
        if handle.forward_end is not None:
            self.forward_time += handle.forward_start.elapsed_time(handle.forward_end) / 1e3
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
        attn = AttentionInputs(
            req_pool_indices=self._to_device([row]),
            seq_lens=self._to_device([n]),
            extend_lens=self._to_device([n]),
            out_cache_loc=self._to_device(slots),
            seq_lens_cpu=(n,),
            extend_lens_cpu=(n,),
        )
        self.backend.prepare(attn)
        fwd = ForwardBatch(self._to_device(input_ids), self._to_device(list(range(n))), None)
        return self.model(fwd, self.backend).float()
