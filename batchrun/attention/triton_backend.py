"""Triton attention over the paged KV pool (kernels in the top-level kernels/ folder).

Decode steps (every extend_len 1) run the split-KV flash-decoding kernel; all other steps run the
extend kernel. Both read prefix and new KV from the pool through req_to_token, after `forward`
has stored the new tokens' k/v. A mixed step (the scheduler puts its decoding requests first,
then the prefill chunks) runs both: the decode kernel on the leading one-token requests and the
extend kernel on the rest. NOTE: the decode kernel packs a KV head's query group into one program
and reads each request's KV once; the extend kernel reads it once per query head (4x for a 4:1
GQA model), so decodes through the extend kernel cost a mixed step several times their KV reads.

A layer's sliding window (`window=`) goes to both kernels as a runtime value: they read only the
window's KV, and layers of different windows share the compiled kernels (a CUDA graph captures
each layer's call with its window).

With KernelPlan.extend_attention "fa3" the extend rows (a prefill step's, a mixed step's after
its decodes) run FlashInfer's FlashAttention-3 paged prefill instead of the extend kernel
(fa3_prefill.py's wrappers, planned once a step for those rows); the decode rows and the
CUDA graphs stay on the decode kernel. engine/kernel_choice.py decides where it runs.

CUDA graphs (decode only). The graph runner owns capture and replay; this backend gives it
static inputs and a launch grid that depends only on the batch size:

    backend.init_graph_buffers(max_bs)         once, before any capture
    per captured size bs:
        backend.prepare_graph(bs)              forward() now reads the static buffers [:bs]
        model forward once, eagerly            warm-up: compiles kernels, allocates the workspace
        with torch.cuda.graph(g): model forward
    per step with n <= bs decode requests:
        backend.load_graph_inputs(inputs, bs)  the copy rule below
        g.replay()
    backend.prepare(inputs) for any eager step switches graph mode off again.

Copy rule (what load_graph_inputs does; a runner may do the same copies itself): rows [0, n) of
graph_req_pool_indices / graph_seq_lens / graph_out_cache_loc get the real batch's
req_pool_indices / seq_lens / out_cache_loc; padding rows [n, bs) get the dummy request row
(req_to_token.shape[0] - 1), seq_len 1 and the pool's dummy slot. Padding rows write only the
dummy slot and their output is to be dropped. Nothing else is read from the host at replay: the
number of KV splits is fixed per bs and each split finds its KV range from seq_lens on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchrun.attention.base import AttentionBackend, AttentionInputs
from batchrun.config import KernelPlan
from batchrun.kernels.decode_attention import (
    DecodeRope,
    decode_attention_fwd,
    decode_counters,
    decode_workspace_numel,
)
from batchrun.kernels.extend_attention import extend_attention_fwd
from batchrun.kernels.tile_fit import shared_memory_limit

# NOTE: W3 (batch 1, 8 KV heads: 16 splits) reads faster than with at most 8 splits, and 32
# no faster (docs/benchmarks.md, Kernels: Decode attention)
MAX_KV_SPLITS = 16
# NOTE: the decode kernel's own rotary and store (DecodeRope) serve CUDA-graph decode batches up
# to this size, whose variant compiles at capture, never mid-run; it pays on W3 against the
# rotary-store kernel apart (docs/benchmarks.md, Kernels: Decode attention). Larger batches,
# eager ones included, keep the two kernels.
DECODE_ROPE_MAX_BS = 16
# split the KV until the decode grid has this many programs per SM. NOTE: splitting pays only
# where the grid would leave SMs idle: a grid of 512 programs reads slower in 2 or 16 splits
# than unsplit (docs/benchmarks.md, Kernels: Decode attention)
PROGRAMS_PER_SM = 2
MIN_SPLIT_LEN = 64  # ... but give no split fewer KV tokens than this (eager only)


@dataclass(frozen=True)
class _DecodePlan:
    req_pool_indices: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B]
    out_cache_loc: torch.Tensor  # [B]
    num_kv_splits: int
    is_graph: bool


@dataclass(frozen=True)
class _ExtendPlan:
    inputs: AttentionInputs
    extend_start_loc: torch.Tensor | None  # [B], exclusive cumsum of extend_lens (None: fa3)
    max_extend_len: int  # (0: fa3)


@dataclass(frozen=True)
class _MixedPlan:
    decode: _DecodePlan  # the first num_decode_tokens requests (one new token each)
    extend: _ExtendPlan  # the rest; its token indices start at num_decode_tokens
    num_decode_tokens: int
    out_cache_loc: torch.Tensor  # [T], every new token's KV slot (one store for both parts)


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, kv_pool, req_to_token: torch.Tensor, kernels: KernelPlan):
        self.kv_pool = kv_pool
        self.pdl = kernels.pdl
        self.req_to_token = req_to_token
        k0 = kv_pool.k_buffers[0]
        self.device = k0.device
        # the most over the layers (Gemma 4's differ): the workspaces and counters fit each
        self.num_kv_heads = max(k.shape[1] for k in kv_pool.k_buffers)
        self.head_dim = max(k.shape[2] for k in kv_pool.k_buffers)
        self.num_sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self.device.type == "cuda"
            else 132
        )
        self.shared_memory = shared_memory_limit(self.device)  # the kernels' tiles fit it
        self._plan: _DecodePlan | _ExtendPlan | None = None
        self._workspace = torch.empty(0, dtype=torch.float32, device=self.device)  # eager, grows
        self.graph_max_bs = 0
        self._graph_workspace: torch.Tensor | None = None  # allocated once, never replaced
        # the decode kernel's split counters (each call leaves them zero): as the workspaces
        self._counters = decode_counters(0, self.num_kv_heads, self.device)  # eager, grows
        self._graph_counters: torch.Tensor | None = None  # init_graph_buffers, never replaced
        self._fa3 = None  # extend_attention "fa3": FlashInfer's prefill of the extend rows
        if kernels.extend_attention == "fa3":
            from batchrun.attention.fa3_prefill import FA3Prefill

            self._fa3 = FA3Prefill(kv_pool, req_to_token)

    # ---- eager steps -------------------------------------------------------------------------

    def prepare(self, inputs: AttentionInputs) -> None:
        if inputs.is_decode:
            self._plan = self._decode_plan(inputs)
        else:
            num_decode = _leading_ones(inputs.extend_lens_cpu)
            if num_decode == 0:
                self._plan = self._extend_plan(inputs)
            else:
                self._plan = _MixedPlan(
                    self._decode_plan(_rows(inputs, 0, num_decode)),
                    self._extend_plan(_rows(inputs, num_decode, inputs.batch_size)),
                    num_decode,
                    inputs.out_cache_loc,
                )

    def _decode_plan(self, inputs: AttentionInputs) -> _DecodePlan:
        splits = self._num_kv_splits(inputs.batch_size)
        max_splits = -(-max(inputs.seq_lens_cpu, default=1) // MIN_SPLIT_LEN)
        splits = max(1, min(splits, max_splits))
        return _DecodePlan(
            inputs.req_pool_indices, inputs.seq_lens, inputs.out_cache_loc, splits, False
        )

    def _extend_plan(self, inputs: AttentionInputs) -> _ExtendPlan:
        if self._fa3 is not None:  # its KV indices and indptrs; planned by the first layer
            self._fa3.prepare(inputs)
            return _ExtendPlan(inputs, None, 0)  # (the extend kernel's offsets: not read)
        ext = inputs.extend_lens
        start_loc = torch.cumsum(ext, 0) - ext
        return _ExtendPlan(inputs, start_loc, max(inputs.extend_lens_cpu))

    def _num_kv_splits(self, batch_size: int) -> int:
        programs = max(1, batch_size * self.num_kv_heads)
        return max(1, min(MAX_KV_SPLITS, -(-PROGRAMS_PER_SM * self.num_sms // programs)))

    def forward(
        self, q, k, v, layer_id: int, scaling: float, out=None, window=0, sinks=None
    ) -> torch.Tensor:
        if k is not None:  # None: a layer that reads another layer's KV
            self.kv_pool.store(layer_id, self._out_cache_loc(), k, v)
        return self._attend(q, layer_id, scaling, out, window, sinks)

    def forward_rotary(
        self, q, k, v, layer_id: int, scaling: float, positions, rotary, out=None, window=0,
        sinks=None,
    ) -> torch.Tensor:  # fmt: skip
        """forward() of q and k before rotary. A CUDA-graph decode batch of up to
        DECODE_ROPE_MAX_BS rows: the decode kernel rotates q and the new k itself and stores
        the new k and v (kernels/decode_attention.py's DecodeRope), reading the older KV before
        its PDL wait. Otherwise KVPool.store_rotated (one kernel rotates q in place and stores
        the rotated k with v), then the attention; the same bits. k stays unrotated either
        way, which is safe because the decode and extend kernels read keys only from the
        pool."""
        loc = self._out_cache_loc()
        plan = self._plan
        if not self._rotates_in_decode(layer_id, loc, q, k, v, positions, rotary):
            q = self.kv_pool.store_rotated(layer_id, loc, q, k, v, positions, rotary)
            return self._attend(q, layer_id, scaling, out, window, sinks)
        out = torch.empty_like(q) if out is None else out
        k_buf, v_buf = self.kv_pool.buffers(layer_id)
        rope = DecodeRope(k, v, loc, positions, rotary.cos_cache, rotary.sin_cache)
        kv_scale = self._kv_scale(layer_id)
        self._decode(plan, q, k_buf, v_buf, out, scaling, kv_scale, window, rope, sinks)
        num_tokens, num_heads, head_dim = q.shape
        return out.view(num_tokens, num_heads * head_dim)

    def _rotates_in_decode(self, layer_id, loc, q, k, v, positions, rotary) -> bool:
        """Whether forward_rotary takes the decode kernel's own rotary and store: a CUDA-graph
        decode plan of at most DECODE_ROPE_MAX_BS rows and the Triton rotary-store conditions
        (KVPool.fuses_rotary: the same bits)."""
        plan = self._plan
        return (
            isinstance(plan, _DecodePlan)
            and plan.is_graph
            and q.shape[0] <= DECODE_ROPE_MAX_BS
            and self.kv_pool.fuses_rotary(layer_id, loc, q, k, v, positions, rotary)
        )

    def _out_cache_loc(self) -> torch.Tensor:
        """[T] KV slots of the step's new tokens (every plan stores all of them at once)."""
        plan = self._plan
        assert plan is not None, "prepare() or prepare_graph() must run before forward()"
        if isinstance(plan, _ExtendPlan):
            return plan.inputs.out_cache_loc
        return plan.out_cache_loc

    def _attend(
        self, q, layer_id: int, scaling: float, out, window: int, sinks=None
    ) -> torch.Tensor:
        """Attention of q over the pool, which holds the new tokens' KV already (each query over
        the last `window` positions where window > 0)."""
        plan = self._plan
        num_tokens, num_heads, head_dim = q.shape
        k_buf, v_buf = self.kv_pool.buffers(layer_id)
        kv_scale = self._kv_scale(layer_id)
        if out is None:
            out = torch.empty_like(q)
        if isinstance(plan, _MixedPlan):
            d = plan.num_decode_tokens
            self._decode(
                plan.decode, q[:d], k_buf, v_buf, out[:d], scaling, kv_scale, window, None, sinks
            )
            self._extend(plan.extend, q[d:], layer_id, out[d:], scaling, kv_scale, window, sinks)
        elif isinstance(plan, _DecodePlan):
            self._decode(plan, q, k_buf, v_buf, out, scaling, kv_scale, window, None, sinks)
        else:
            self._extend(plan, q, layer_id, out, scaling, kv_scale, window, sinks)
        return out.view(num_tokens, num_heads * head_dim)

    def _kv_scale(self, layer_id: int):
        """The layer's KV scales for the kernels (None: the pool is in the compute dtype)."""
        return self.kv_pool.scales(layer_id) if self.kv_pool.is_fp8 else None

    def _decode(
        self, plan: _DecodePlan, q, k_buf, v_buf, out, scaling: float, kv_scale, window,
        rope=None, sinks=None,
    ) -> None:  # fmt: skip
        bs, num_heads, head_dim = q.shape
        workspace = self._get_workspace(plan, bs, num_heads, head_dim)
        counters = self._get_counters(plan, bs)
        decode_attention_fwd(
            q, k_buf, v_buf, out, self.req_to_token, plan.req_pool_indices, plan.seq_lens,
            scaling, plan.num_kv_splits, workspace, counters, window=window, rope=rope,
            kv_scale=kv_scale, pdl=self.pdl, sinks=sinks, shared_memory=self.shared_memory,
        )  # fmt: skip

    def _extend(
        self, plan: _ExtendPlan, q, layer_id: int, out, scaling: float, kv_scale, window: int,
        sinks=None,
    ) -> None:  # fmt: skip
        if self._fa3 is not None:  # (kernel_choice: no float8 pool, no sinks)
            self._fa3.attend(q, layer_id, scaling, out, window)
            return
        inputs = plan.inputs
        k_buf, v_buf = self.kv_pool.buffers(layer_id)
        extend_attention_fwd(
            q, k_buf, v_buf, out, self.req_to_token, inputs.req_pool_indices, inputs.seq_lens,
            inputs.extend_lens, plan.extend_start_loc, plan.max_extend_len, scaling,
            kv_scale=kv_scale, window=window, sinks=sinks, shared_memory=self.shared_memory,
        )  # fmt: skip

    def _get_workspace(self, plan: _DecodePlan, bs: int, num_heads: int, head_dim: int):
        if plan.is_graph:
            if self._graph_workspace is None:
                # NOTE: sized for every graph batch size at once, so that it is never replaced
                # while captured graphs point into it
                capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
                assert not capturing, "run one eager forward after prepare_graph(), then capture"
                most = max(b * self._num_kv_splits(b) for b in range(1, self.graph_max_bs + 1))
                numel = decode_workspace_numel(most, num_heads, max(head_dim, self.head_dim), 1)
                self._graph_workspace = torch.empty(numel, dtype=torch.float32, device=self.device)
            return self._graph_workspace
        numel = decode_workspace_numel(bs, num_heads, head_dim, plan.num_kv_splits)
        if self._workspace.numel() < numel:
            self._workspace = torch.empty(numel, dtype=torch.float32, device=self.device)
        return self._workspace

    def _get_counters(self, plan: _DecodePlan, bs: int) -> torch.Tensor:
        if plan.is_graph:
            assert self._graph_counters is not None, "init_graph_buffers() first"
            return self._graph_counters
        if self._counters.numel() < bs * self.num_kv_heads:
            self._counters = decode_counters(bs, self.num_kv_heads, self.device)
        return self._counters

    # ---- CUDA graphs (decode) ----------------------------------------------------------------

    def init_graph_buffers(self, max_bs: int) -> None:
        """Static decode inputs for batch sizes up to max_bs (see the module docstring)."""
        dev = self.device
        self.graph_max_bs = max_bs
        self._graph_workspace = None  # re-sized at the next warm-up: recapture every graph
        # NOTE: before any capture, sized for every graph batch size (like the workspace)
        self._graph_counters = decode_counters(max_bs, self.num_kv_heads, dev)
        self.graph_req_pool_indices = torch.full(
            (max_bs,), self.req_to_token.shape[0] - 1, dtype=torch.int64, device=dev
        )
        self.graph_seq_lens = torch.ones(max_bs, dtype=torch.int64, device=dev)
        self.graph_out_cache_loc = torch.full(
            (max_bs,), self.kv_pool.dummy_slot, dtype=torch.int64, device=dev
        )

    def prepare_graph(self, bs: int) -> None:
        """Switch forward() to the static buffers [:bs], with a num_kv_splits fixed per bs."""
        assert 0 < bs <= self.graph_max_bs, (bs, self.graph_max_bs)
        self._plan = _DecodePlan(
            self.graph_req_pool_indices[:bs],
            self.graph_seq_lens[:bs],
            self.graph_out_cache_loc[:bs],
            self._num_kv_splits(bs),
            True,
        )

    def graph_static_inputs(self) -> tuple[tuple[torch.Tensor, ...], int, int]:
        buffers = (self.graph_req_pool_indices, self.graph_seq_lens, self.graph_out_cache_loc)
        return buffers, self.req_to_token.shape[0] - 1, self.kv_pool.dummy_slot

    def load_graph_inputs(self, inputs: AttentionInputs, bs: int) -> None:
        """Copy a decode batch of n <= bs requests into the static buffers, padding to bs."""
        n = inputs.batch_size
        assert inputs.is_decode and n <= bs <= self.graph_max_bs, (n, bs)
        self.graph_req_pool_indices[:n].copy_(inputs.req_pool_indices, non_blocking=True)
        self.graph_seq_lens[:n].copy_(inputs.seq_lens, non_blocking=True)
        self.graph_out_cache_loc[:n].copy_(inputs.out_cache_loc, non_blocking=True)
        if n < bs:
            self.graph_req_pool_indices[n:bs].fill_(self.req_to_token.shape[0] - 1)
            self.graph_seq_lens[n:bs].fill_(1)
            self.graph_out_cache_loc[n:bs].fill_(self.kv_pool.dummy_slot)


def _leading_ones(extend_lens: tuple[int, ...]) -> int:
    """How many requests at the front of the batch add exactly one token (the decodes)."""
    n = 0
    for e in extend_lens:
        if e != 1:
            break
        n += 1
    return n


def _rows(inputs: AttentionInputs, start: int, stop: int) -> AttentionInputs:
    """Requests [start, stop) of a batch (views; tokens are sliced to match)."""
    ext = inputs.extend_lens_cpu
    t0, t1 = sum(ext[:start]), sum(ext[:stop])
    return AttentionInputs(
        req_pool_indices=inputs.req_pool_indices[start:stop],
        seq_lens=inputs.seq_lens[start:stop],
        extend_lens=inputs.extend_lens[start:stop],
        out_cache_loc=inputs.out_cache_loc[t0:t1],
        seq_lens_cpu=inputs.seq_lens_cpu[start:stop],
        extend_lens_cpu=ext[start:stop],
    )
