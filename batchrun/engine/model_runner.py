"""The device side of a step: turns a ScheduledBatch into tensors, runs the model and the sampler.

All host-to-device copies go through pinned buffers with non_blocking=True on CUDA; the only
device-to-host transfer is the sampled tokens (and logprobs when asked).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from batchrun.attention import AttentionInputs, create_backend
from batchrun.engine.config import EngineConfig
from batchrun.engine.kv_pool import KVPool, ReqToTokenPool
from batchrun.engine.sampler import PenaltyState, Sampler, SamplingBatch
from batchrun.engine.scheduler import ScheduledBatch
from batchrun.models.config import ModelConfig
from batchrun.models.llama import ForwardBatch
from batchrun.models.loader import load_model

log = logging.getLogger(__name__)


class StepOutput(NamedTuple):
    next_token_ids: list[int]  # one per sampling request, in batch order
    logprobs: list[float] | None
    top_logprobs: list[tuple[list[int], list[float]]] | None


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
        )
        self.num_slots = self._kv_slots()
        self.kv_pool = KVPool(
            model_cfg.num_layers,
            self.num_slots,
            model_cfg.num_kv_heads,
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

    def _kv_slots(self) -> int:
        cfg, page = self.config, self.config.page_size
        if cfg.kv_budget is not None:
            return max(page, cfg.kv_budget // page * page)
        per_token = KVPool.bytes_per_token(
            self.model_cfg.num_layers,
            self.model_cfg.num_kv_heads,
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

    def forward(self, batch: ScheduledBatch, sampling: SamplingBatch | None) -> StepOutput:
        seq_lens = batch.seq_lens
        rows = [r.row for r in batch.reqs]
        attn = AttentionInputs(
            req_pool_indices=self._to_device(rows),
            seq_lens=self._to_device(list(seq_lens)),
            extend_lens=self._to_device(list(batch.extend_lens)),
            out_cache_loc=self._to_device(batch.out_cache_loc),
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=batch.extend_lens,
        )
        self.backend.prepare(attn)
        logits_indices = []
        end = 0
        for n, sampled in zip(batch.extend_lens, batch.sample_mask):
            end += n
            if sampled:
                logits_indices.append(end - 1)
        fwd = ForwardBatch(
            input_ids=self._to_device(batch.input_ids),
            positions=self._to_device(batch.positions),
            logits_indices=self._to_device(logits_indices),
        )
        logits = self.model(fwd, self.backend)  # [S, V] fp32
        if sampling is None:
            return StepOutput([], None, None)
        out = self.sampler(logits, sampling, self.penalties)
        if sampling.has_penalties:
            self.penalties.update(sampling.rows, out.next_token_ids)
        # the one device-to-host transfer of the step
        next_ids = out.next_token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        top = None
        if out.top_logprob_ids is not None:
            top = list(zip(out.top_logprob_ids.tolist(), out.top_logprob_vals.tolist()))
        return StepOutput(next_ids, logprobs, top)

    @torch.inference_mode()
    def all_logits(self, input_ids: list[int], slots: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits [T, V] of one sequence, outside the scheduler (tests, scoring).
        `slots`: free KV slots (at least len(input_ids)) lent by the caller."""
        n = len(input_ids)
        row = self.req_pool.dummy_row
        slots = slots[:n]
        self.req_pool.write(row, 0, slots)
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
        return self.model(fwd, self.backend)
