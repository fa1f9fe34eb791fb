"""FlashInfer attention over the paged KV pool, with page size 1: one KV slot is one page.

Each step hands FlashInfer a CSR view of the batch's KV, built without reading device memory:

    kv_indptr      [B + 1] int32, host    0, cumsum(seq_lens): request b's pages are
                                          kv_indices[kv_indptr[b] : kv_indptr[b + 1]]
    kv_indices     [sum(seq_lens)] int32  req_to_token[row_b, 0 : seq_len_b] for b = 0 .. B-1,
                                          gathered on the device (the total is a host number)
    last_page_len  [B] int32, host        all 1 (page size 1)
    qo_indptr      [B + 1] int32, host    0, cumsum(extend_lens) (prefill wrapper only)

The per-layer buffers [slots + 1, kv_heads, head_dim] are FlashInfer's NHD paged layout once
viewed as [slots + 1, 1, kv_heads, head_dim] (no copy). Decode steps (every extend_len 1) run a
BatchDecodeWithPagedKVCacheWrapper (on tensor cores from GQA group 4 on), all other steps a
BatchPrefillWithPagedKVCacheWrapper with causal=True, whose mask is aligned bottom-right: the
queries are the last extend_len positions of each request's KV, as base.py draws.

A float8_e4m3fn pool (--kv-cache-dtype fp8_e4m3) is planned with kv_data_type float8_e4m3fn
(q and the output stay in the compute dtype); each layer's run() gets its k_scale, which
FlashInfer folds into the softmax scale, and its v_scale, which it multiplies into the output.

plan() is host work (it schedules the batch and copies the schedule to the device); it needs the
softmax scale and the query head count, which only forward() is given, so the first forward of
a step plans and the other layers reuse the plan.

A sliding window W is a plan parameter too (`window_left` W - 1: the query at position p sees the
keys p - window_left <= k <= p, base.py's rule), so each distinct window of the model has its own
wrappers, planned by the first layer of that window each step: a model of one window (every
layer W, or none) plans one wrapper a step; a model with local and global layers plans two.

CUDA graphs (decode only), the interface of triton_backend.py:

    backend.init_graph_buffers(max_bs)         static kv_indptr / kv_indices / last_page_len /
                                               out_cache_loc buffers, shared by all batch sizes
    per captured size bs:
        backend.prepare_graph(bs)              forward() now uses the bs wrapper
                                               (use_cuda_graph=True, buffers: views of the static
                                               ones) over an all-padding batch
        model forward once, eagerly            warm-up: creates and plans the wrapper, JIT
                                               compiles its kernels
        with torch.cuda.graph(g): model forward    runs the wrapper only: no plan() in the graph
    per step with n <= bs decode requests:
        backend.load_graph_inputs(inputs, bs)  fills the static buffers (rows [n, bs) padding)
                                               and re-plans the bs wrapper on the host
        g.replay()
    backend.prepare(inputs) for any eager step switches graph mode off again.

Padding rows are a request of seq_len 1 whose one page is the pool's dummy slot, and whose new
token is stored into the dummy slot: they read and write no real KV; their output is dropped.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import shutil
from dataclasses import dataclass

import torch

from batchrun.attention.base import AttentionBackend, AttentionInputs, refuse_sinks

WORKSPACE_BYTES = 384 << 20  # float workspace (split-KV partial results), shared by all wrappers;
# NOTE: 128 MiB is too small for a 32-head, head-dim-128 prefill over a long cached prefix (H200)
TENSOR_CORE_MIN_GROUP = 4  # decode on tensor cores from this GQA group size on (as SGLang does)
# NOTE: FlashAttention-2 kernels on every GPU, as SGLang runs its paged wrappers (FlashInfer's
# 'auto' picks its FA3 kernels on Hopper)
KERNELS = "fa2"
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)
KV_DTYPES = (*DTYPES, torch.float8_e4m3fn)


def import_flashinfer():
    """The flashinfer module, or ImportError saying what to do."""
    try:
        import flashinfer
    except Exception as e:  # ImportError, or an install that does not match torch / CUDA
        raise ImportError(
            f"flashinfer is not importable ({type(e).__name__}: {e}); install flashinfer-python "
            "for this torch and CUDA, or use --attention-backend triton, torch or auto"
        ) from e
    return flashinfer


def unavailable_reason(device) -> str | None:
    """Why the FlashInfer backend cannot run on `device` (None: it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return (
            f"it needs a CUDA device, and this run uses {device.type!r}; "
            "use --attention-backend torch or auto"
        )
    if not torch.cuda.is_available():
        return "CUDA is not available here; use --attention-backend torch or auto"
    try:
        import_flashinfer()
    except ImportError as e:
        return str(e)
    return None


def fa3_unavailable_reason(device, head_dim: int, dtype: str, kv_fp8: bool, sinks: bool):
    """Why FlashInfer's FlashAttention-3 prefill cannot run a model's extend rows on `device`
    (None: it can). dtype: EngineConfig.dtype ("auto": bf16 or fp16 on CUDA)."""
    reason = unavailable_reason(device)
    if reason is not None:
        return reason
    device = torch.device(device)
    index = torch.cuda.current_device() if device.index is None else device.index
    if torch.cuda.get_device_capability(index)[0] != 9:
        return "FlashInfer's FA3 kernels run on sm_90 GPUs (H100, H200) only"
    if head_dim not in HEAD_DIMS:
        return f"they support head dims {HEAD_DIMS}, and this model's is {head_dim}"
    if dtype not in ("auto", "bfloat16", "float16"):
        return f"they run in bfloat16 or float16, and this run's dtype is {dtype}"
    if kv_fp8:
        return "they read a bf16 / fp16 KV cache with bf16 / fp16 queries, not a float8 one"
    if sinks:
        return "they run no attention sinks, which this model has"
    return _build_reason()


def _build_reason() -> str | None:
    """Why FlashInfer cannot have its FA3 prefill kernels here (None: it can). They come
    compiled in the flashinfer-jit-cache package, or flashinfer compiles them with nvcc at
    first use, finding the CUDA toolkit as torch's extension builder does (CUDA_HOME,
    CUDA_PATH, nvcc on PATH, /usr/local/cuda). Read once, at start-up."""
    if importlib.util.find_spec("flashinfer_jit_cache") is not None:
        return None
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvccs = [shutil.which("nvcc")] + [os.path.join(h, "bin", "nvcc") for h in homes if h]
    if any(n and os.path.isfile(n) for n in nvccs):
        return None
    return (
        "FlashInfer compiles its FA3 kernels with nvcc at first use, and neither nvcc (CUDA_HOME, "
        "CUDA_PATH, PATH, /usr/local/cuda) nor the flashinfer-jit-cache package is here"
    )


PROBE_TOKENS = 16


def fa3_run_error(
    device, num_heads: int, num_kv_heads: int, head_dim: int, dtype, windows=(0,)
) -> str | None:
    """FlashInfer's FA3 prefill run on a PROBE_TOKENS-token causal batch with a model's heads
    (one rank's) and dtype, as FlashInferAttentionBackend plans and runs it, once for the whole
    context if `windows` (the model's layers' sliding windows, 0: none) holds a 0 and once
    windowed if it holds another (FlashInfer builds the two as separate kernels): None when
    they ran, else the error. The first call on a machine builds the kernels (nvcc, about 80 s
    on an H100) into flashinfer's cache, where the engine's steps find them; a build that fails
    (an nvcc that does not match torch's CUDA, say) fails here, at start-up, not at the first
    prefill. Call where fa3_unavailable_reason is None."""
    fi = import_flashinfer()
    device, n = torch.device(device), PROBE_TOKENS
    windowed = [w for w in windows if w > 0]
    lefts = [-1] if 0 in windows or not windows else []  # window_left: -1 the whole context
    lefts += [min(windowed[0], n) - 1] if windowed else []
    try:
        workspace = torch.zeros(16 << 20, dtype=torch.uint8, device=device)
        indptr = torch.tensor([0, n], dtype=torch.int32)
        indices = torch.arange(n, dtype=torch.int32, device=device)
        last_page_len = torch.ones(1, dtype=torch.int32)
        q = torch.zeros((n, num_heads, head_dim), dtype=dtype, device=device)
        kv = torch.zeros((n, 1, num_kv_heads, head_dim), dtype=dtype, device=device)
        for window_left in lefts:
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa3")
            wrapper.plan(
                indptr, indptr, indices, last_page_len, num_heads, num_kv_heads, head_dim, 1,
                causal=True, q_data_type=dtype, kv_data_type=dtype, sm_scale=head_dim**-0.5,
                window_left=window_left,
            )  # fmt: skip
            out = wrapper.run(q, (kv, kv))
            torch.cuda.synchronize(device)
            if out.shape != q.shape:
                return f"it returned {tuple(out.shape)} for a query of {tuple(q.shape)}"
    except Exception as e:  # a failed build or launch: its message is the reason
        lines = [line for line in str(e).splitlines() if line.strip()]
        return f"{type(e).__name__}: {' / '.join(lines[-3:])[:600]}"
    return None


def gather_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    total: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each request's KV slots for positions [0, seq_len), concatenated: [total] int32.

    `total` is sum(seq_lens), known on the host, so nothing here waits for the device.
    """
    dev = req_to_token.device
    req = torch.repeat_interleave(seq_lens, output_size=total)  # [N] request of each entry
    starts = torch.cumsum(seq_lens, 0) - seq_lens  # [B]
    pos = torch.arange(total, device=dev) - starts[req]  # [N] position inside its request
    slots = req_to_token[req_pool_indices[req], pos]  # [N]
    if out is None:
        return slots.to(torch.int32)
    return out.copy_(slots)


@dataclass(frozen=True)
class _Batch:
    """What plan() and forward() read for one step (see the module docstring)."""

    kv_indptr_cpu: torch.Tensor  # [B + 1] int32, pinned
    kv_indices: torch.Tensor  # [sum(seq_lens)] int32, device
    last_page_len_cpu: torch.Tensor  # [B] int32, pinned, all 1
    qo_indptr_cpu: torch.Tensor | None  # [B + 1] int32, pinned; None: a decode batch
    out_cache_loc: torch.Tensor  # [T] KV slots of the new tokens
    graph_bs: int | None = None  # planned on the CUDA-graph wrapper of this size; None: eager


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(self, kv_pool, req_to_token: torch.Tensor, prefill_kernels: str = KERNELS):
        """prefill_kernels: the prefill wrappers' FlashInfer backend, "fa2" (KERNELS) or "fa3"
        (its Hopper kernels: scripts/bench_attention_kernels.py times both on long extends)."""
        self.fi = import_flashinfer()
        self.prefill_kernels = prefill_kernels
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        k0 = kv_pool.k_buffers[0]
        self.device = k0.device
        self.kv_dtype = k0.dtype
        self.num_kv_heads = k0.shape[1]
        self.head_dim = k0.shape[2]
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(
                f"the flashinfer attention backend runs in float16 or bfloat16, not "
                f"{self.kv_dtype}; use --dtype bfloat16 (or another attention backend)"
            )
        if len({tuple(k.shape[1:]) for k in kv_pool.k_buffers}) > 1:
            raise ValueError(
                "the flashinfer attention backend runs one head dim and KV-head count in every "
                "layer, and this model's layers differ; use --attention-backend triton"
            )
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(
                f"the flashinfer attention backend supports head dims {HEAD_DIMS}, not "
                f"{self.head_dim}; use --attention-backend triton"
            )
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._pin = self.device.type == "cuda"  # (a CPU device only in tests, with a stand-in)
        # window (0: the whole context) -> the eager wrapper of that window
        self._prefill_wrappers: dict[int, object] = {}
        self._decode_wrappers: dict[int, object] = {}
        self._ones_cpu = torch.ones(0, dtype=torch.int32)
        # NOTE: plan() writes its schedule into a pinned host buffer of the wrapper and copies it
        # to the device without waiting. Under overlap the host may plan step n+1 before the
        # device has run step n's copy, so each wrapper waits on an event recorded after its
        # previous plan() (a whole step earlier: in practice it has long completed)
        self._plan_done: dict[int, torch.cuda.Event] = {}
        self._batch: _Batch | None = None
        # window -> (the wrapper planned for self._batch, the (num_heads, dtype, scaling) it was
        # planned with)
        self._planned: dict[int, tuple[object, tuple]] = {}
        self.graph_max_bs = 0
        self._graph_wrappers: dict[tuple[int, int], object] = {}  # (bs, window) -> wrapper
        self._graph_batch: _Batch | None = None  # the batch last loaded into the static buffers
        self._graph_params: dict[int, tuple] = {}  # window -> the params its graphs planned

    # ---- eager steps -------------------------------------------------------------------------

    def prepare(self, inputs: AttentionInputs) -> None:
        seq_lens = list(inputs.seq_lens_cpu)
        total = sum(seq_lens)
        indices = gather_kv_indices(
            self.req_to_token, inputs.req_pool_indices, inputs.seq_lens, total
        )
        qo_indptr = None if inputs.is_decode else self._indptr(inputs.extend_lens_cpu)
        self._batch = _Batch(
            self._indptr(seq_lens),
            indices,
            self._ones(len(seq_lens)),
            qo_indptr,
            inputs.out_cache_loc,
        )
        self._planned = {}

    def forward(
        self, q, k, v, layer_id: int, scaling: float, out=None, window=0, sinks=None
    ) -> torch.Tensor:
        refuse_sinks(sinks, "flashinfer")
        batch, wrapper = self._planned_wrapper(q, scaling, window)
        if k is not None:  # None: a layer that reads another layer's KV
            self.kv_pool.store(layer_id, batch.out_cache_loc, k, v)
        return self._run(wrapper, q, layer_id, out)

    def forward_rotary(
        self, q, k, v, layer_id: int, scaling: float, positions, rotary, out=None, window=0,
        sinks=None,
    ) -> torch.Tensor:  # fmt: skip
        """forward() of q and k before rotary, rotated in the KV store's kernel
        (KVPool.store_rotated): k stays unrotated, which is safe because the wrappers read keys
        only from the pool."""
        refuse_sinks(sinks, "flashinfer")
        batch, wrapper = self._planned_wrapper(q, scaling, window)
        q = self.kv_pool.store_rotated(layer_id, batch.out_cache_loc, q, k, v, positions, rotary)
        return self._run(wrapper, q, layer_id, out)

    def attend(self, q, layer_id: int, scaling: float, out, window: int = 0) -> torch.Tensor:
        """Attention of q over the pool, which holds the step's new KV already (stored by the
        caller): the extend rows of triton_backend.py's steps under extend_attention "fa3"."""
        _, wrapper = self._planned_wrapper(q, scaling, window)
        return self._run(wrapper, q, layer_id, out)

    def _planned_wrapper(self, q, scaling: float, window: int):
        """The step's batch and the wrapper of `window` planned for it with q's heads and dtype
        (by the first layer of that window)."""
        batch = self._batch
        assert batch is not None, "prepare() or prepare_graph() must run before forward()"
        params = (q.shape[1], q.dtype, scaling)
        planned = self._planned.get(window)
        if planned is None or planned[1] != params:
            planned = self._planned[window] = (self._plan(batch, params, window), params)
        return batch, planned[0]

    def _run(self, wrapper, q, layer_id: int, out) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        k_buf, v_buf = self.kv_pool.buffers(layer_id)
        paged = (k_buf.unsqueeze(1), v_buf.unsqueeze(1))  # [slots + 1, 1, KV, D] each
        if out is None:
            out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
        scales = {}
        if self.kv_pool.is_fp8:
            scale = self.kv_pool.scales(layer_id)
            scales = {"k_scale": scale.k, "v_scale": scale.v}
        wrapper.run(q, paged, out=out, **scales)
        return out.view(num_tokens, num_heads * head_dim)

    def _plan(self, batch: _Batch, params: tuple, window: int):
        """The wrapper of `window` for the batch's kind, planned for it."""
        if self.device.type == "cuda":
            capturing = torch.cuda.is_current_stream_capturing()
            assert not capturing, "run one eager forward after prepare_graph(), then capture"
        num_heads, dtype = params[0], params[1]
        if dtype not in DTYPES:  # (a float8 pool does not say the compute dtype up front)
            raise ValueError(
                f"the flashinfer attention backend runs in float16 or bfloat16, not {dtype}; "
                "use --dtype bfloat16 (or another attention backend)"
            )
        if batch.graph_bs is not None:
            wrapper = self._graph_wrapper(batch.graph_bs, num_heads, window)
            self._graph_params[window] = params
        elif batch.qo_indptr_cpu is None:
            wrapper = self._decode_wrappers.get(window)
            if wrapper is None:
                wrapper = self._decode_wrappers[window] = (
                    self.fi.BatchDecodeWithPagedKVCacheWrapper(
                        self.workspace,
                        "NHD",
                        use_tensor_cores=self._use_tensor_cores(num_heads),
                        backend=KERNELS,
                    )
                )
        else:
            wrapper = self._prefill_wrappers.get(window)
            if wrapper is None:
                wrapper = self._prefill_wrappers[window] = (
                    self.fi.BatchPrefillWithPagedKVCacheWrapper(
                        self.workspace, "NHD", backend=self.prefill_kernels
                    )
                )
        self._plan_wrapper(wrapper, batch, params, window)
        return wrapper

    def _plan_wrapper(self, wrapper, batch: _Batch, params: tuple, window: int) -> None:
        num_heads, dtype, scaling = params
        done = self._plan_done.get(id(wrapper))
        if done is not None:
            done.synchronize()  # the copy of this wrapper's previous plan (see __init__)
        shape = (num_heads, self.num_kv_heads, self.head_dim, 1)  # page size 1
        kw = dict(q_data_type=dtype, kv_data_type=self.kv_dtype, sm_scale=scaling)
        kw["window_left"] = window - 1 if window > 0 else -1  # -1: the whole context
        if batch.qo_indptr_cpu is None:
            wrapper.plan(
                batch.kv_indptr_cpu, batch.kv_indices, batch.last_page_len_cpu, *shape,
                non_blocking=True, **kw,
            )  # fmt: skip
        else:
            wrapper.plan(
                batch.qo_indptr_cpu, batch.kv_indptr_cpu, batch.kv_indices,
                batch.last_page_len_cpu, *shape, causal=True, non_blocking=True, **kw,
            )  # fmt: skip
        if self._pin:
            self._plan_done.setdefault(id(wrapper), torch.cuda.Event()).record()

    def _use_tensor_cores(self, num_heads: int) -> bool:
        return num_heads // self.num_kv_heads >= TENSOR_CORE_MIN_GROUP

    def _indptr(self, lens) -> torch.Tensor:
        values = list(itertools.accumulate(lens, initial=0))
        return torch.tensor(values, dtype=torch.int32, pin_memory=self._pin)

    def _ones(self, n: int) -> torch.Tensor:
        if self._ones_cpu.numel() < n:
            size = max(n, self.req_to_token.shape[0], self.graph_max_bs)
            self._ones_cpu = torch.ones(size, dtype=torch.int32, pin_memory=self._pin)
        return self._ones_cpu[:n]

    # ---- CUDA graphs (decode) ----------------------------------------------------------------

    def init_graph_buffers(self, max_bs: int) -> None:
        """Static decode inputs for batch sizes up to max_bs (see the module docstring)."""
        dev, dummy = self.device, self.kv_pool.dummy_slot
        self.graph_max_bs = max_bs
        # NOTE: requests may share prefix slots, so only the context bound caps the page count
        max_pages = max_bs * self.req_to_token.shape[1]
        self._graph_kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self._graph_kv_indices = torch.full((max_pages,), dummy, dtype=torch.int32, device=dev)
        self._graph_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self._graph_out_cache_loc = torch.full((max_bs,), dummy, dtype=torch.int64, device=dev)
        self._graph_wrappers = {}  # wrappers hold the old buffers: recapture every graph
        self._graph_batch = None
        self._graph_params = {}

    def prepare_graph(self, bs: int) -> None:
        """Switch forward() to the bs wrapper, over the batch last loaded if it has size bs, else
        over padding; the next forward plans it, so run one eagerly before capturing."""
        assert 0 < bs <= self.graph_max_bs, (bs, self.graph_max_bs)
        batch = self._graph_batch
        if batch is None or batch.graph_bs != bs:
            batch = self._load_graph_batch(bs, None)
        self._batch, self._planned = batch, {}

    def load_graph_inputs(self, inputs: AttentionInputs, bs: int) -> None:
        """Copy a decode batch of n <= bs requests into the static buffers, padded to bs, and
        plan the bs wrappers (one a window) for it (host work, before the replay)."""
        n = inputs.batch_size
        assert inputs.is_decode and n <= bs <= self.graph_max_bs, (n, bs)
        batch = self._load_graph_batch(bs, inputs)
        self._batch, self._planned = batch, {}
        for window, params in self._graph_params.items():
            wrapper = self._graph_wrappers.get((bs, window))
            if wrapper is not None:
                self._plan_wrapper(wrapper, batch, params, window)
                self._planned[window] = (wrapper, params)

    def _load_graph_batch(self, bs: int, inputs: AttentionInputs | None) -> _Batch:
        dummy, max_pages = self.kv_pool.dummy_slot, self._graph_kv_indices.numel()
        seq_lens = list(inputs.seq_lens_cpu) if inputs is not None else []
        n, real = len(seq_lens), sum(seq_lens)
        total = real + bs - n  # one page per padding row
        if total > max_pages:
            raise ValueError(f"{total} KV pages exceed the graph buffer's {max_pages}")
        if n:
            gather_kv_indices(
                self.req_to_token, inputs.req_pool_indices, inputs.seq_lens, real,
                out=self._graph_kv_indices[:real],
            )  # fmt: skip
            self._graph_out_cache_loc[:n].copy_(inputs.out_cache_loc, non_blocking=True)
        if n < bs:
            self._graph_kv_indices[real:total].fill_(dummy)
            self._graph_out_cache_loc[n:bs].fill_(dummy)
        batch = _Batch(
            self._indptr(seq_lens + [1] * (bs - n)),
            self._graph_kv_indices[:total],
            self._ones(bs),
            None,
            self._graph_out_cache_loc[:bs],
            graph_bs=bs,
        )
        self._graph_batch = batch
        return batch

    def _graph_wrapper(self, bs: int, num_heads: int, window: int):
        wrapper = self._graph_wrappers.get((bs, window))
        if wrapper is None:
            wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self._use_tensor_cores(num_heads),
                paged_kv_indptr_buffer=self._graph_kv_indptr[: bs + 1],
                paged_kv_indices_buffer=self._graph_kv_indices,
                paged_kv_last_page_len_buffer=self._graph_last_page_len[:bs],
                backend=KERNELS,
            )
            self._graph_wrappers[bs, window] = wrapper
        return wrapper
