"""FlashInfer's FlashAttention-3 paged prefill on the extend rows of the Triton backend's steps
(triton_backend.py; the decode rows stay on its decode kernel). Page size 1: one KV slot is one
page. engine/kernel_choice.py decides where it runs (fa3_cache.py: only where its kernels are
built already).

Each step hands FlashInfer a CSR view of the extend rows' KV, built without reading device
memory:

    kv_indptr      [B + 1] int32, host    0, cumsum(seq_lens): request b's pages are
                                          kv_indices[kv_indptr[b] : kv_indptr[b + 1]]
    kv_indices     [sum(seq_lens)] int32  req_to_token[row_b, 0 : seq_len_b] for b = 0 .. B-1,
                                          gathered on the device (the total is a host number)
    last_page_len  [B] int32, host        all 1 (page size 1)
    qo_indptr      [B + 1] int32, host    0, cumsum(extend_lens)

The per-layer buffers [slots + 1, kv_heads, head_dim] are FlashInfer's NHD paged layout once
viewed as [slots + 1, 1, kv_heads, head_dim] (no copy). A BatchPrefillWithPagedKVCacheWrapper
runs with causal=True, whose mask is aligned bottom-right: the queries are the last extend_len
positions of each request's KV, as base.py draws. The pool holds the step's new KV already (the
caller stores it).

plan() is host work (it schedules the batch and copies the schedule to the device); it needs the
softmax scale and the query head count, which only attend() is given, so the first layer of a
step plans and the other layers reuse the plan. A sliding window W is a plan parameter too
(`window_left` W - 1), so each distinct window of the model has its own wrapper, planned by the
first layer of that window each step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from batchrun.attention.base import AttentionInputs
from batchrun.attention.fa3_cache import DTYPES, import_flashinfer

WORKSPACE_BYTES = 384 << 20  # float workspace (split-KV partial results), shared by the wrappers;
# NOTE: 128 MiB is too small for a 32-head, head-dim-128 prefill over a long cached prefix


def gather_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    total: int,
) -> torch.Tensor:
    """Each request's KV slots for positions [0, seq_len), concatenated: [total] int32.

    `total` is sum(seq_lens), known on the host, so nothing here waits for the device.
    """
    dev = req_to_token.device
    req = torch.repeat_interleave(seq_lens, output_size=total)  # [N] request of each entry
    starts = torch.cumsum(seq_lens, 0) - seq_lens  # [B]
    pos = torch.arange(total, device=dev) - starts[req]  # [N] position inside its request
    return req_to_token[req_pool_indices[req], pos].to(torch.int32)  # [N]


@dataclass(frozen=True)
class _Batch:
    """What plan() and attend() read for one step (see the module docstring)."""

    kv_indptr_cpu: torch.Tensor  # [B + 1] int32, pinned
    kv_indices: torch.Tensor  # [sum(seq_lens)] int32, device
    last_page_len_cpu: torch.Tensor  # [B] int32, pinned, all 1
    qo_indptr_cpu: torch.Tensor  # [B + 1] int32, pinned


class FA3Prefill:
    """The extend rows' attention over the paged KV pool: prepare() once a step, attend() a
    layer."""

    def __init__(self, kv_pool, req_to_token: torch.Tensor):
        self.fi = import_flashinfer()
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        k0 = kv_pool.k_buffers[0]
        self.device = k0.device
        self.kv_dtype = k0.dtype
        self.num_kv_heads = k0.shape[1]
        self.head_dim = k0.shape[2]
        if self.kv_dtype not in DTYPES:
            raise ValueError(
                f"FlashInfer's FA3 prefill reads a float16 or bfloat16 KV pool, not "
                f"{self.kv_dtype}; engine/kernel_choice.py keeps such a pool on the Triton kernel"
            )
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._pin = self.device.type == "cuda"  # (a CPU device only in tests, with a stand-in)
        self._wrappers: dict[int, object] = {}  # window (0: the whole context) -> its wrapper
        # NOTE: plan() writes its schedule into a pinned host buffer of the wrapper and copies it
        # to the device without waiting. Under overlap the host may plan step n+1 before the
        # device has run step n's copy, so each wrapper waits on an event recorded after its
        # previous plan() (a whole step earlier: in practice it has long completed)
        self._plan_done: dict[int, torch.cuda.Event] = {}
        self._batch: _Batch | None = None
        # window -> (the wrapper planned for self._batch, the (num_heads, dtype, scaling) it was
        # planned with)
        self._planned: dict[int, tuple[object, tuple]] = {}

    def prepare(self, inputs: AttentionInputs) -> None:
        """The step's extend rows (no decode rows among them)."""
        seq_lens = list(inputs.seq_lens_cpu)
        total = sum(seq_lens)
        indices = gather_kv_indices(
            self.req_to_token, inputs.req_pool_indices, inputs.seq_lens, total
        )
        self._batch = _Batch(
            self._indptr(seq_lens),
            indices,
            torch.ones(len(seq_lens), dtype=torch.int32, pin_memory=self._pin),
            self._indptr(inputs.extend_lens_cpu),
        )
        self._planned = {}

    def attend(self, q, layer_id: int, scaling: float, out, window: int = 0) -> torch.Tensor:
        """Attention of q [T, H, D] over the pool into out [T, H, D]; returns out as [T, H * D]."""
        batch = self._batch
        assert batch is not None, "prepare() must run before attend()"
        params = (q.shape[1], q.dtype, scaling)
        planned = self._planned.get(window)
        if planned is None or planned[1] != params:
            planned = self._planned[window] = (self._plan(batch, params, window), params)
        num_tokens, num_heads, head_dim = q.shape
        k_buf, v_buf = self.kv_pool.buffers(layer_id)
        paged = (k_buf.unsqueeze(1), v_buf.unsqueeze(1))  # [slots + 1, 1, KV, D] each
        planned[0].run(q, paged, out=out)
        return out.view(num_tokens, num_heads * head_dim)

    def _plan(self, batch: _Batch, params: tuple, window: int):
        """The wrapper of `window`, planned for the batch."""
        num_heads, dtype, scaling = params
        if dtype not in DTYPES:
            raise ValueError(f"FlashInfer's FA3 prefill runs in float16 or bfloat16, not {dtype}")
        wrapper = self._wrappers.get(window)
        if wrapper is None:
            wrapper = self._wrappers[window] = self.fi.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", backend="fa3"
            )
        done = self._plan_done.get(window)
        if done is not None:
            done.synchronize()  # the copy of this wrapper's previous plan (see __init__)
        wrapper.plan(
            batch.qo_indptr_cpu, batch.kv_indptr_cpu, batch.kv_indices, batch.last_page_len_cpu,
            num_heads, self.num_kv_heads, self.head_dim, 1, causal=True, non_blocking=True,
            q_data_type=dtype, kv_data_type=self.kv_dtype, sm_scale=scaling,
            window_left=window - 1 if window > 0 else -1,  # -1: the whole context
        )  # fmt: skip
        if self._pin:
            self._plan_done.setdefault(window, torch.cuda.Event()).record()
        return wrapper

    def _indptr(self, lens) -> torch.Tensor:
        values = list(itertools.accumulate(lens, initial=0))
        return torch.tensor(values, dtype=torch.int32, pin_memory=self._pin)
