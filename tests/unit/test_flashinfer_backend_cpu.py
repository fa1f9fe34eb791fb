"""The FlashInfer backend's CPU-side parts: the module imports without flashinfer, selecting it
where it cannot run says what to do, and the KV page indices it hands to plan() are right."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import llama3_model_config  # noqa: E402

from batchrun.attention import create_backend  # noqa: E402
from batchrun.attention import flashinfer_backend as fib  # noqa: E402
from batchrun.config import EngineConfig, KernelConfig  # noqa: E402
from batchrun.engine.kernel_choice import resolve_kernels  # noqa: E402
from batchrun.engine.kv_pool import KVPool  # noqa: E402


def test_module_imports_without_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises
    with pytest.raises(ImportError, match="pip|install flashinfer-python"):
        fib.import_flashinfer()
    reason = fib.unavailable_reason("cuda")
    if torch.cuda.is_available():
        assert "flashinfer is not importable" in reason and "--attention-backend" in reason


def test_selecting_flashinfer_on_cpu_says_what_to_do():
    model_cfg, cpu = llama3_model_config("tiny"), torch.device("cpu")

    def resolve(attention: str) -> KernelConfig:
        config = EngineConfig(kernels=KernelConfig(attention=attention), chunked_prefill_size=64)
        return resolve_kernels(config, model_cfg, cpu)

    with pytest.raises(ValueError, match="flashinfer.*CUDA device.*--attention-backend torch"):
        resolve("flashinfer")
    # auto never picks it on the CPU
    pool = KVPool(1, 8, 2, 64, torch.float32, "cpu")
    table = torch.zeros(3, 16, dtype=torch.int32)
    backend = create_backend(resolve("auto"), pool, table)
    assert type(backend).__name__ == "TorchAttentionBackend"
    with pytest.raises(ValueError, match="attention backend must be one of"):
        resolve("flashattn")


@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_gather_kv_indices(table_dtype):
    gen = torch.Generator().manual_seed(0)
    table = torch.randint(0, 1000, (6, 40), generator=gen).to(table_dtype)
    rows, seq_lens = [4, 0, 2, 5], [1, 40, 7, 13]
    expected = torch.cat([table[r, :n] for r, n in zip(rows, seq_lens)]).int()
    got = fib.gather_kv_indices(table, torch.tensor(rows), torch.tensor(seq_lens), sum(seq_lens))
    assert got.dtype == torch.int32 and torch.equal(got, expected)
    out = torch.full((sum(seq_lens) + 5,), -1, dtype=torch.int32)
    fib.gather_kv_indices(
        table, torch.tensor(rows), torch.tensor(seq_lens), sum(seq_lens), out=out[:-5]
    )
    assert torch.equal(out[:-5], expected) and (out[-5:] == -1).all()


# ---- the backend's plumbing on the CPU, over a stand-in for flashinfer --------------------------
# The stand-in follows flashinfer 0.6's documented contract (page table in CSR form, NHD pages,
# causal mask aligned bottom-right, CUDA-graph wrappers reading their fixed buffers at run time)
# in plain torch: it checks what the backend hands to plan() and when it plans, not the kernels
# (tests/gpu/test_flashinfer_backend.py runs the real ones).


def _attend(q, paged_kv, qo_indptr, kv_indptr, kv_indices, scale, out, window_left=-1):
    k_cache, v_cache = paged_kv  # [P, 1, KV, D]
    group = q.shape[1] // k_cache.shape[2]
    for b in range(len(kv_indptr) - 1):
        pages = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
        qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
        keys = k_cache[pages, 0].float().repeat_interleave(group, 1)  # [S, H, D]
        values = v_cache[pages, 0].float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), keys) * scale
        n, s = qe - qs, len(pages)
        k_pos, q_pos = torch.arange(s)[None, :], torch.arange(s - n, s)[:, None]
        visible = k_pos <= q_pos  # bottom-right
        if window_left >= 0:  # flashinfer's window: keys q_pos - window_left <= k <= q_pos
            visible &= k_pos >= q_pos - window_left
        scores = scores.masked_fill(~visible, float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(out.dtype)


class _Wrapper:
    def __init__(self, workspace, kv_layout, use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend="auto"):  # fmt: skip
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.graph, self.use_tensor_cores = use_cuda_graph, use_tensor_cores
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer)
        self.bs = len(paged_kv_last_page_len_buffer) if use_cuda_graph else None
        self.num_plans = 0

    def _plan(self, qo_indptr, indptr, indices, last_page_len, page_size, sm_scale, window_left):
        assert page_size == 1 and (last_page_len == 1).all()
        for host in (qo_indptr, indptr, last_page_len):  # host tensors: plan() does not sync
            assert host.device.type == "cpu" and host.dtype == torch.int32
        assert indices.dtype == torch.int32 and len(indices) == int(indptr[-1])
        if self.graph:
            assert len(last_page_len) == self.bs, "a graph wrapper plans its own batch size only"
            self.buffers[0].copy_(indptr)
            self.buffers[1][: len(indices)].copy_(indices)
            indptr, indices = self.buffers
        if self.num_plans:  # flashinfer compiles a wrapper's kernels for its window at plan time
            assert (window_left >= 0) == (self.window_left >= 0), "a wrapper keeps its window"
        self.window_left = window_left
        self.state = (qo_indptr, indptr, indices, sm_scale)
        self.num_plans += 1

    def run(self, q, paged_kv, out, k_scale=None, v_scale=None):
        # a float8 cache: k_scale multiplies sm_scale, v_scale the output (flashinfer 0.6)
        assert (k_scale is not None) == (self.kv_data_type == torch.float8_e4m3fn)
        qo_indptr, indptr, indices, scale = self.state
        scale = scale * (k_scale or 1.0)
        _attend(q, paged_kv, qo_indptr, indptr, indices, scale, out, self.window_left)
        if v_scale is not None:
            out *= v_scale
        return out


class _Decode(_Wrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *, q_data_type, kv_data_type, sm_scale, non_blocking,
             window_left=-1):  # fmt: skip
        qo_indptr = torch.arange(len(indptr), dtype=torch.int32)
        self.kv_data_type = kv_data_type
        self._plan(qo_indptr, indptr, indices, last_page_len, page_size, sm_scale, window_left)


class _Prefill(_Wrapper):
    def plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
             head_dim, page_size, *, causal, q_data_type, kv_data_type, sm_scale,
             non_blocking, window_left=-1):  # fmt: skip
        assert causal
        self.kv_data_type = kv_data_type
        self._plan(qo_indptr, indptr, indices, last_page_len, page_size, sm_scale, window_left)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    import types

    module = types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=_Decode, BatchPrefillWithPagedKVCacheWrapper=_Prefill
    )
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(fib, "WORKSPACE_BYTES", 1024)


def _batch(seq_lens, extend_lens, num_heads, num_kv_heads, head_dim=64, seed=0):
    """A 2-layer fp16 pool holding shuffled prefixes, and the new tokens' q, k, v."""
    from batchrun.attention.base import AttentionInputs

    gen = torch.Generator().manual_seed(seed)
    num_slots = sum(seq_lens) + 5
    pool = KVPool(2, num_slots, num_kv_heads, head_dim, torch.float16, "cpu")
    for buf in pool.k_buffers + pool.v_buffers:
        buf.copy_(torch.randn(buf.shape, generator=gen))
    table = torch.zeros(len(seq_lens) + 3, max(seq_lens) + 4, dtype=torch.int32)
    rows = torch.randperm(len(seq_lens) + 2, generator=gen)[: len(seq_lens)]
    perm, start, locs = torch.randperm(num_slots, generator=gen), 0, []
    for row, seq_len, ext in zip(rows.tolist(), seq_lens, extend_lens):
        table[row, :seq_len] = perm[start : start + seq_len].int()
        locs.append(perm[start + seq_len - ext : start + seq_len])
        start += seq_len
    table[-1, 0] = pool.dummy_slot  # the dummy request, as the graph runner sets it
    t = sum(extend_lens)
    q, k, v = (torch.randn(t, n, head_dim, generator=gen).half() for n in
               (num_heads, num_kv_heads, num_kv_heads))  # fmt: skip
    inputs = AttentionInputs(
        req_pool_indices=rows.long(),
        seq_lens=torch.tensor(seq_lens),
        extend_lens=torch.tensor(extend_lens),
        out_cache_loc=torch.cat(locs).long(),
        seq_lens_cpu=tuple(seq_lens),
        extend_lens_cpu=tuple(extend_lens),
    )
    return pool, table, inputs, q, k, v


def _reference(pool, table, inputs, q, k, v, layer_id, scaling, window=0):
    from batchrun.attention.torch_backend import TorchAttentionBackend

    ref_pool = KVPool(2, pool.num_slots, k.shape[1], k.shape[2], torch.float32, "cpu")
    for src, dst in zip(pool.k_buffers + pool.v_buffers, ref_pool.k_buffers + ref_pool.v_buffers):
        dst.copy_(src)
    backend = TorchAttentionBackend(ref_pool, table)
    backend.prepare(inputs)
    return backend.forward(q.float(), k.float(), v.float(), layer_id, scaling, window=window)


@pytest.mark.parametrize(
    "seq_lens, extend_lens",
    [([1, 40, 9], [1, 1, 1]), ([30, 12], [30, 5]), ([1, 50, 8, 20], [1, 1, 8, 3])],
    ids=["decode", "extend-prefix", "mixed"],
)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (16, 2)], ids=["g1", "g4", "g8"])
def test_eager_steps_over_stand_in(fake_flashinfer, seq_lens, extend_lens, heads):
    pool, table, inputs, q, k, v = _batch(seq_lens, extend_lens, *heads)
    backend = fib.FlashInferAttentionBackend(pool, table)
    backend.prepare(inputs)
    for layer_id in (0, 1):
        ref = _reference(pool, table, inputs, q, k, v, layer_id, 0.1)
        out = backend.forward(q, k, v, layer_id, 0.1)
        assert out.shape == (len(q), heads[0] * 64)
        assert (out.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
        assert torch.equal(pool.k_buffers[layer_id][inputs.out_cache_loc], k)
        assert torch.equal(pool.v_buffers[layer_id][inputs.out_cache_loc], v)
    [(wrapper, _)] = backend._planned.values()
    assert wrapper.num_plans == 1, "one plan per step, shared by the layers"
    assert isinstance(wrapper, _Decode) == all(n == 1 for n in extend_lens)
    if isinstance(wrapper, _Decode):
        assert wrapper.use_tensor_cores == (heads[0] // heads[1] >= 4)


def test_graph_flow_over_stand_in(fake_flashinfer):
    from batchrun.attention.base import AttentionInputs

    num_heads, num_kv_heads, d = 8, 2, 64
    seq_lens = [5, 33, 17, 1, 60]
    pool, table, filled, *_ = _batch(seq_lens, [1] * 5, num_heads, num_kv_heads)
    backend = fib.FlashInferAttentionBackend(pool, table)
    backend.init_graph_buffers(8)
    static = {
        bs: [torch.zeros(bs, n, d, dtype=torch.float16) for n in (num_heads, num_kv_heads, 2)]
        for bs in (8, 4)
    }
    for bs in (8, 4):  # what the graph runner does: prepare, warm up, capture
        backend.prepare_graph(bs)
        backend.forward(*static[bs], 0, 0.125)  # warm-up: plans
        wrapper = backend._graph_wrappers[bs, 0]
        assert wrapper.graph and wrapper.num_plans == 1
        backend.forward(*static[bs], 0, 0.125)  # "capture": must not plan
        assert wrapper.num_plans == 1
    wrapper = backend._graph_wrappers[4, 0]
    gen = torch.Generator().manual_seed(1)
    for n, rows in ((3, [0, 2, 4]), (4, [1, 2, 3, 4])):
        rows_t = filled.req_pool_indices[rows]
        lens = [seq_lens[i] for i in rows]
        inputs = AttentionInputs(
            req_pool_indices=rows_t,
            seq_lens=torch.tensor(lens),
            extend_lens=torch.ones(n, dtype=torch.int64),
            out_cache_loc=torch.stack([table[r, s - 1] for r, s in zip(rows_t, lens)]).long(),
            seq_lens_cpu=tuple(lens),
            extend_lens_cpu=(1,) * n,
        )
        q, k, v = static[4]
        for t in static[4]:
            t.copy_(torch.randn(t.shape, generator=gen))
        k_before = pool.k_buffers[0].clone()
        plans = wrapper.num_plans
        backend.load_graph_inputs(inputs, 4)  # plans on the host, before the replay
        assert wrapper.num_plans == plans + 1
        out = backend.forward(q, k, v, 0, 0.125)  # "replay"
        assert wrapper.num_plans == plans + 1
        changed = (pool.k_buffers[0] != k_before).flatten(1).any(1).nonzero().flatten().tolist()
        assert set(changed) <= {*inputs.out_cache_loc.tolist(), pool.dummy_slot}
        ref = _reference(pool, table, inputs, q[:n], k[:n], v[:n], 0, 0.125)
        assert (out[:n].float() - ref).abs().max() <= 1e-2 * ref.abs().max()
    backend.prepare(filled)  # an eager step leaves graph mode
    assert not backend._batch.graph_bs


@pytest.mark.parametrize(
    "seq_lens, extend_lens",
    [([1, 40, 9], [1, 1, 1]), ([1, 50, 8], [1, 1, 8])],
    ids=["decode", "mixed"],
)
def test_fp8_kv_cache_over_stand_in(fake_flashinfer, seq_lens, extend_lens):
    """A float8 pool: planned with kv_data_type float8_e4m3fn, each layer run with its k_scale
    and v_scale, the new tokens stored quantized; the output as an fp32 pool of the dequantized
    values gives."""
    from batchrun.quant.kv_cache import KVScale, quantize_kv

    pool16, table, inputs, q, k, v = _batch(seq_lens, extend_lens, 8, 2)
    scales = [KVScale(0.5, 0.25), KVScale(0.125, 2.0)]
    pool = KVPool(2, pool16.num_slots, 2, 64, torch.float8_e4m3fn, "cpu", None, scales)
    for layer_id, scale in enumerate(scales):
        pool.k_buffers[layer_id].copy_(quantize_kv(pool16.k_buffers[layer_id], scale.inv_k))
        pool.v_buffers[layer_id].copy_(quantize_kv(pool16.v_buffers[layer_id], scale.inv_v))
    backend = fib.FlashInferAttentionBackend(pool, table)
    backend.prepare(inputs)
    for layer_id, scale in enumerate(scales):
        out = backend.forward(q, k, v, layer_id, 0.1)
        assert backend._planned[0][0].kv_data_type == torch.float8_e4m3fn
        loc = inputs.out_cache_loc
        want = quantize_kv(k, scale.inv_k).view(torch.uint8)
        assert torch.equal(pool.k_buffers[layer_id][loc].view(torch.uint8), want)
        deq = KVPool(2, pool.num_slots, 2, 64, torch.float32, "cpu")
        deq.k_buffers[layer_id].copy_(pool.k_buffers[layer_id].float() * scale.k)
        deq.v_buffers[layer_id].copy_(pool.v_buffers[layer_id].float() * scale.v)
        ref = _reference(deq, table, inputs, q, deq.k_buffers[layer_id][loc],
                         deq.v_buffers[layer_id][loc], layer_id, 0.1)  # fmt: skip
        assert (out.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
    # the compute dtype shows with the first forward: float32 is refused there
    backend.prepare(inputs)
    with pytest.raises(ValueError, match="float16 or bfloat16, not torch.float32"):
        backend.forward(q.float(), k.float(), v.float(), 0, 0.1)


@pytest.mark.parametrize(
    "seq_lens, extend_lens",
    [([1, 40, 9], [1, 1, 1]), ([30, 12], [30, 5]), ([1, 50, 8, 20], [1, 1, 8, 3])],
    ids=["decode", "extend-prefix", "mixed"],
)
def test_sliding_windows_over_stand_in(fake_flashinfer, seq_lens, extend_lens):
    """Layers of two windows (a global layer 0, a local layer 1 of window 8, as Gemma 3 mixes
    them): each window's wrapper is planned with window_left W - 1 once a step, and the output
    is the torch backend's with the window. A model of one window plans one wrapper a step."""
    pool, table, inputs, q, k, v = _batch(seq_lens, extend_lens, 8, 2)
    backend = fib.FlashInferAttentionBackend(pool, table)
    for step in range(2):
        backend.prepare(inputs)
        for layer_id, window in ((0, 0), (1, 8), (0, 0), (1, 8)):  # two layers of each
            ref = _reference(pool, table, inputs, q, k, v, layer_id, 0.1, window)
            out = backend.forward(q, k, v, layer_id, 0.1, window=window)
            assert (out.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
        planned = {w: wrapper for w, (wrapper, _) in backend._planned.items()}
        assert planned.keys() == {0, 8} and planned[0] is not planned[8]
        assert planned[0].window_left == -1 and planned[8].window_left == 7
        assert [w.num_plans for w in planned.values()] == [step + 1] * 2
    # the window hides keys: the local layer's output differs from the whole context's
    ref_full = _reference(pool, table, inputs, q, k, v, 1, 0.1)
    assert not torch.allclose(out.float(), ref_full, atol=1e-2)

    backend = fib.FlashInferAttentionBackend(pool, table)
    backend.prepare(inputs)
    for layer_id in (0, 1):
        backend.forward(q, k, v, layer_id, 0.1, window=8)
    [(wrapper, _)] = backend._planned.values()
    assert wrapper.num_plans == 1


def test_graph_flow_with_two_windows_over_stand_in(fake_flashinfer):
    """CUDA graphs: a wrapper per (batch size, window), each planned at warm-up and re-planned
    by load_graph_inputs before every replay."""
    from batchrun.attention.base import AttentionInputs

    seq_lens = [5, 33, 17, 1, 60]
    pool, table, filled, *_ = _batch(seq_lens, [1] * 5, 8, 2)
    backend = fib.FlashInferAttentionBackend(pool, table)
    backend.init_graph_buffers(4)
    static = [torch.zeros(4, n, 64, dtype=torch.float16) for n in (8, 2, 2)]
    backend.prepare_graph(4)
    for layer_id, window in ((0, 0), (1, 16)):  # warm-up
        backend.forward(*static, layer_id, 0.125, window=window)
    assert backend._graph_wrappers.keys() == {(4, 0), (4, 16)}
    rows = [1, 2, 3, 4]
    rows_t = filled.req_pool_indices[rows]
    lens = [seq_lens[i] for i in rows]
    inputs = AttentionInputs(
        req_pool_indices=rows_t,
        seq_lens=torch.tensor(lens),
        extend_lens=torch.ones(4, dtype=torch.int64),
        out_cache_loc=torch.stack([table[r, s - 1] for r, s in zip(rows_t, lens)]).long(),
        seq_lens_cpu=tuple(lens),
        extend_lens_cpu=(1,) * 4,
    )
    gen = torch.Generator().manual_seed(1)
    for t in static:
        t.copy_(torch.randn(t.shape, generator=gen))
    backend.load_graph_inputs(inputs, 4)
    assert [w.num_plans for w in backend._graph_wrappers.values()] == [2, 2]
    for layer_id, window in ((0, 0), (1, 16)):  # "replay": no plan
        out = backend.forward(*static, layer_id, 0.125, window=window)
        ref = _reference(pool, table, inputs, *static, layer_id, 0.125, window)
        assert (out.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
    assert [w.num_plans for w in backend._graph_wrappers.values()] == [2, 2]
