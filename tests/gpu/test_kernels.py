"""Triton attention kernels and backend against the torch reference backend (fp32), on CUDA.

Every kernel output is NaN-filled first, so an element the kernel forgets to write fails the test.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from batchrun.kernels.decode_attention import (  # noqa: E402
    decode_attention_fwd,
    decode_counters,
    decode_workspace_numel,
)
from batchrun.kernels.extend_attention import extend_attention_fwd  # noqa: E402

from batchrun.attention.base import AttentionInputs  # noqa: E402
from batchrun.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from batchrun.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from batchrun.config import KernelPlan  # noqa: E402
from batchrun.engine.kv_pool import KVPool  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = "cuda"
# max |out - ref| / max |ref| against the fp32 reference of the same rounded inputs
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
HEADS = [(32, 8), (9, 3)]  # Llama-3 GQA, SmolLM2
# the Triton backend's config (it reads `pdl`; tests/gpu/test_pdl.py runs PDL end to end)
BACKEND_KERNELS = KernelPlan(attention="triton", triton_ops=True, pdl=False)


def make_batch(seq_lens, extend_lens, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """A KV pool holding each request's prefix in shuffled slots, plus the new tokens' q/k/v."""
    gen = torch.Generator().manual_seed(seed)
    gen_gpu = torch.Generator(device=DEV).manual_seed(seed)
    batch_size, total = len(seq_lens), sum(seq_lens)
    num_slots = total + 13
    pool = KVPool(1, num_slots, num_kv_heads, head_dim, dtype, DEV)
    for buf in (pool.k_buffers[0], pool.v_buffers[0]):
        buf.copy_(torch.randn(buf.shape, generator=gen_gpu, device=DEV))
    max_context = -(-(max(seq_lens) + 7) // 16) * 16  # 16-aligned rows: fewer variants
    table = torch.zeros(batch_size + 3, max_context, dtype=torch.int32)
    rows = torch.randperm(batch_size + 2, generator=gen)[:batch_size]
    perm = torch.randperm(num_slots, generator=gen)
    locs, start = [], 0
    for row, seq_len, ext in zip(rows.tolist(), seq_lens, extend_lens):
        slots = perm[start : start + seq_len]
        table[row, :seq_len] = slots.int()
        locs.append(slots[seq_len - ext :])
        start += seq_len
    num_tokens = sum(extend_lens)
    q, k, v = (
        torch.randn(num_tokens, n, head_dim, generator=gen_gpu, device=DEV).to(dtype)
        for n in (num_heads, num_kv_heads, num_kv_heads)
    )
    inputs = AttentionInputs(
        req_pool_indices=rows.long().to(DEV),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=DEV),
        extend_lens=torch.tensor(extend_lens, dtype=torch.int64, device=DEV),
        out_cache_loc=torch.cat(locs).long().to(DEV),
        seq_lens_cpu=tuple(seq_lens),
        extend_lens_cpu=tuple(extend_lens),
    )
    return pool, table.to(DEV), inputs, q, k, v


def reference(pool, table, inputs, q, k, v, scaling):
    """The torch backend in fp32 over an fp32 copy of the pool: [T, H, D] fp32."""
    ref_pool = KVPool(1, pool.num_slots, pool.k_buffers[0].shape[1], q.shape[2], torch.float32, DEV)
    ref_pool.k_buffers[0].copy_(pool.k_buffers[0])
    ref_pool.v_buffers[0].copy_(pool.v_buffers[0])
    backend = TorchAttentionBackend(ref_pool, table)
    backend.prepare(inputs)
    out = backend.forward(q.float(), k.float(), v.float(), 0, scaling)
    pool.store(0, inputs.out_cache_loc, k, v)  # what the triton backend does before its kernels
    return out.view(q.shape)


def assert_close(out, ref, dtype):
    assert not out.isnan().any(), "kernel left elements unwritten"
    err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
    assert err <= TOL[dtype], f"max relative error {err:.2e} > {TOL[dtype]:.0e}"


def ragged(rng, n, lo, hi):
    return [rng.randint(lo, hi) for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("heads", HEADS, ids=["gqa32_8", "gqa9_3"])
@pytest.mark.parametrize("batch_size", [1, 7, 64], ids=["b1", "b7", "b64"])
def test_decode_matches_reference(batch_size, heads, head_dim, dtype):
    rng = random.Random(batch_size * 1000 + head_dim)
    seq_lens = [777] if batch_size == 1 else [1, 33, *ragged(rng, batch_size - 2, 1, 1500)]
    num_heads, num_kv_heads = heads
    pool, table, inputs, q, k, v = make_batch(
        seq_lens, [1] * batch_size, num_heads, num_kv_heads, head_dim, dtype
    )
    scaling = head_dim**-0.5
    ref = reference(pool, table, inputs, q, k, v, scaling)
    counters = decode_counters(batch_size, num_kv_heads, DEV)
    for splits in (1, 5, 16):  # 16 leaves many splits of short requests empty
        numel = decode_workspace_numel(batch_size, num_heads, head_dim, splits)
        workspace = torch.empty(numel, dtype=torch.float32, device=DEV)
        out = torch.full_like(q, float("nan"))
        decode_attention_fwd(
            q, *pool.buffers(0), out, table, inputs.req_pool_indices, inputs.seq_lens,
            scaling, splits, workspace, counters,
        )  # fmt: skip
        assert_close(out, ref, dtype)
        assert not counters.any(), "the last split program left its counter set"


def decode(pool, table, inputs, q, splits, scaling, counters=None, **kwargs):
    """decode_attention_fwd into a NaN-filled output, on a NaN-filled workspace."""
    batch_size, num_heads, head_dim = q.shape
    numel = decode_workspace_numel(batch_size, num_heads, head_dim, splits)
    workspace = torch.full((numel,), float("nan"), device=DEV)
    if counters is None:
        counters = decode_counters(batch_size, pool.k_buffers[0].shape[1], DEV)
    out = torch.full_like(q, float("nan"))
    decode_attention_fwd(
        q, *pool.buffers(0), out, table, inputs.req_pool_indices, inputs.seq_lens, scaling,
        splits, workspace, counters, **kwargs,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("num_warps", [4, 8], ids=["w4", "w8"])
@pytest.mark.parametrize(
    "shape", [(1, (32, 8), 128), (7, (9, 3), 64), (64, (32, 8), 128)], ids=["b1", "b7", "b64"]
)
def test_decode_split_combine_is_deterministic(shape, num_warps):
    """The combine of the KV splits, folded into the split programs (the last one of a KV head
    sums every split in a fixed order): within bf16 bounds of the fp32 reference, every element
    written, the counters reset by every call, and the same bits run to run whichever split
    finishes last."""
    batch_size, (num_heads, num_kv_heads), head_dim = shape
    rng = random.Random(batch_size + num_warps)
    seq_lens = [777] if batch_size == 1 else [1, 33, *ragged(rng, batch_size - 2, 1, 1500)]
    pool, table, inputs, q, k, v = make_batch(
        seq_lens, [1] * batch_size, num_heads, num_kv_heads, head_dim, torch.bfloat16
    )
    ref = reference(pool, table, inputs, q, k, v, 0.1)
    counters = decode_counters(batch_size, num_kv_heads, DEV)
    for splits in (2, 5, 16):
        first = None
        for _ in range(3):  # the same counters again: reset, and the same bits run to run
            folded = decode(pool, table, inputs, q, splits, 0.1, counters, num_warps=num_warps)
            assert not counters.any(), "the last split program left its counter set"
            assert not folded.isnan().any(), "the combine left elements unwritten"
            first = folded if first is None else first
            assert torch.equal(folded, first), splits
        assert_close(first, ref, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("heads", HEADS, ids=["gqa32_8", "gqa9_3"])
@pytest.mark.parametrize("batch_size", [1, 7, 64], ids=["b1", "b7", "b64"])
def test_decode_rope_matches_rotary_store_then_decode(batch_size, heads, head_dim, dtype):
    """The decode kernel that rotates q and the new k itself, stores the new k and v, and reads
    the older KV before its PDL wait (DecodeRope), against kernels/rotary_kv_store.py then the
    plain decode kernel: the same output and the same pool, bit for bit, at 1 / 5 / 16 splits
    (test_decode_rope_graph_replay replays it in a CUDA graph)."""
    from batchrun.kernels.decode_attention import DecodeRope
    from batchrun.kernels.rotary_kv_store import rotary_store_kv

    from batchrun.layers.rotary import RotaryEmbedding

    rng = random.Random(batch_size * 7 + head_dim)
    seq_lens = [777] if batch_size == 1 else [1, 64, 65, *ragged(rng, batch_size - 3, 1, 1500)]
    num_heads, num_kv_heads = heads
    pool, table, inputs, q, k, v = make_batch(
        seq_lens, [1] * batch_size, num_heads, num_kv_heads, head_dim, dtype, seed=3
    )
    rotary = RotaryEmbedding(head_dim, 2048, 500000.0, {}, DEV)
    positions = inputs.seq_lens - 1
    loc, scaling = inputs.out_cache_loc, head_dim**-0.5
    rope = DecodeRope(k, v, loc, positions, rotary.cos_cache, rotary.sin_cache)
    for splits in (1, 5, 16):
        pools = [tuple(b.clone() for b in pool.buffers(0)) for _ in range(2)]
        q_rot = q.clone()
        rotary_store_kv(*pools[0], loc, q_rot, k, v, positions, rotary.cos_cache, rotary.sin_cache)
        outs = []
        for query, bufs, r in ((q_rot, pools[0], None), (q, pools[1], rope)):
            numel = decode_workspace_numel(batch_size, num_heads, head_dim, splits)
            workspace = torch.full((numel,), float("nan"), device=DEV)
            counters = decode_counters(batch_size, num_kv_heads, DEV)
            out = torch.full_like(q, float("nan"))
            decode_attention_fwd(
                query, *bufs, out, table, inputs.req_pool_indices, inputs.seq_lens, scaling,
                splits, workspace, counters, rope=r,
            )  # fmt: skip
            assert not counters.any()
            outs.append(out)
        assert not outs[1].isnan().any()
        assert torch.equal(outs[1], outs[0]), splits
        assert torch.equal(pools[1][0], pools[0][0]) and torch.equal(pools[1][1], pools[0][1])


def test_decode_rope_graph_replay():
    """The rope decode kernel in a CUDA graph (as the decode graphs capture it), replayed with
    new seq_lens, slots and raw q/k/v: the eager rope kernel's output and pool, bit for bit."""
    from batchrun.kernels.decode_attention import DecodeRope

    from batchrun.layers.rotary import RotaryEmbedding

    num_heads, num_kv_heads, head_dim, bs, splits, scaling = 32, 8, 128, 4, 8, 128**-0.5
    max_context = 1200
    pool, table, inputs, q, k, v = make_batch(
        [max_context] * bs, [1] * bs, num_heads, num_kv_heads, head_dim, torch.bfloat16
    )
    rotary = RotaryEmbedding(head_dim, 2048, 500000.0, {}, DEV)
    k_buf, v_buf = pool.buffers(0)
    seq_lens, loc = inputs.seq_lens.clone(), inputs.out_cache_loc.clone()
    positions = seq_lens - 1
    out = torch.empty_like(q)
    workspace = torch.empty(decode_workspace_numel(bs, num_heads, head_dim, splits), device=DEV)
    counters = decode_counters(bs, num_kv_heads, DEV)
    rope = DecodeRope(k, v, loc, positions, rotary.cos_cache, rotary.sin_cache)

    def launch(bufs, dst):
        decode_attention_fwd(
            q, *bufs, dst, table, inputs.req_pool_indices, seq_lens, scaling, splits, workspace,
            counters, rope=rope,
        )  # fmt: skip

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch((k_buf.clone(), v_buf.clone()), torch.empty_like(q))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch((k_buf, v_buf), out)
    rng = random.Random(9)
    for _ in range(3):
        lens = [1, *ragged(rng, bs - 1, 2, max_context)]
        seq_lens.copy_(torch.tensor(lens))
        positions.copy_(seq_lens - 1)
        for i, (row, length) in enumerate(zip(inputs.req_pool_indices.tolist(), lens)):
            loc[i] = table[row, length - 1]  # the new token's slot
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, device=DEV))
        eager_pool = (k_buf.clone(), v_buf.clone())
        eager = torch.full_like(q, float("nan"))
        launch(eager_pool, eager)
        graph.replay()
        assert not counters.any()
        assert torch.equal(out, eager)
        assert torch.equal(k_buf, eager_pool[0]) and torch.equal(v_buf, eager_pool[1])


def test_decode_folded_graph_replay():
    """decode_attention_fwd (the combine folded into the split programs) captured in a CUDA
    graph, replayed with other seq_lens: the counters left zero by every replay and the output
    bit-identical to the eager kernel's."""
    num_heads, num_kv_heads, head_dim, bs, splits, scaling = 32, 8, 128, 4, 8, 128**-0.5
    max_context = 1200
    pool, table, inputs, _, _, _ = make_batch(
        [max_context] * bs, [1] * bs, num_heads, num_kv_heads, head_dim, torch.bfloat16
    )
    k_buf, v_buf = pool.buffers(0)
    q = torch.randn(bs, num_heads, head_dim, device=DEV).bfloat16()
    seq_lens = inputs.seq_lens.clone()  # static: the graph reads it at replay
    out = torch.empty_like(q)
    workspace = torch.empty(decode_workspace_numel(bs, num_heads, head_dim, splits), device=DEV)
    counters = decode_counters(bs, num_kv_heads, DEV)

    def launch():
        decode_attention_fwd(
            q, k_buf, v_buf, out, table, inputs.req_pool_indices, seq_lens, scaling, splits,
            workspace, counters,
        )  # fmt: skip

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compiles outside the capture
        launch()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()

    rng = random.Random(5)
    for _ in range(3):
        lens = [1, *ragged(rng, bs - 1, 2, max_context)]  # request 0: splits 1.. empty
        seq_lens.copy_(torch.tensor(lens))
        q.copy_(torch.randn(q.shape, device=DEV))
        out.fill_(float("nan"))
        graph.replay()
        assert not counters.any(), "a replay left a counter set"
        replayed = replace(inputs, seq_lens=seq_lens.clone(), seq_lens_cpu=tuple(lens))
        assert torch.equal(out, decode(pool, table, replayed, q, splits, scaling))


@pytest.mark.parametrize("prefix", ["none", "mixed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("heads", [*HEADS, (8, 8)], ids=["gqa32_8", "gqa9_3", "mha8_8"])
@pytest.mark.parametrize("batch_size", [1, 7, 64], ids=["b1", "b7", "b64"])
def test_extend_matches_reference(batch_size, heads, head_dim, dtype, prefix):
    rng = random.Random(batch_size * 1000 + head_dim + 1)
    if batch_size == 1:
        extend_lens = [333]
        prefix_lens = [0] if prefix == "none" else [517]
    else:
        extend_lens = [1, 65, *ragged(rng, batch_size - 2, 1, 300)]
        prefix_lens = [0] * batch_size
        if prefix == "mixed":
            prefix_lens = [0, 700, *[rng.choice([0, rng.randint(1, 700)]) for _ in extend_lens[2:]]]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_heads, num_kv_heads = heads
    pool, table, inputs, q, k, v = make_batch(
        seq_lens, extend_lens, num_heads, num_kv_heads, head_dim, dtype
    )
    scaling = head_dim**-0.5
    ref = reference(pool, table, inputs, q, k, v, scaling)
    ext = inputs.extend_lens
    out = torch.full_like(q, float("nan"))
    extend_attention_fwd(
        q, *pool.buffers(0), out, table, inputs.req_pool_indices, inputs.seq_lens, ext,
        torch.cumsum(ext, 0) - ext, max(extend_lens), scaling,
    )  # fmt: skip
    assert_close(out, ref, dtype)


# the configurations that scripts/bench_attention_kernels.py times
DECODE_CONFIGS = [(bn, w, s) for bn in (32, 64) for w in (4, 8) for s in (2, 3)]
DECODE_CONFIGS += [(128, w, 2) for w in (4, 8)]
# packed (GQA) programs: (query tokens, BLOCK_N, warps, stages); GQA 32 / 8 packs 4 heads
PACKED_CONFIGS = [(16, 64, 4, 2), (32, 64, 4, 2), (32, 64, 8, 2), (32, 64, 8, 3), (32, 128, 8, 2),
                  (64, 64, 8, 2)]  # fmt: skip


@pytest.mark.parametrize("config", DECODE_CONFIGS)
def test_decode_configs(config):
    block_n, num_warps, num_stages = config
    seq_lens = [1, 100, 1025, 64, 513]
    pool, table, inputs, q, k, v = make_batch(seq_lens, [1] * 5, 32, 8, 128, torch.bfloat16)
    ref = reference(pool, table, inputs, q, k, v, 0.1)
    workspace = torch.empty(decode_workspace_numel(5, 32, 128, 4), device=DEV)
    counters = decode_counters(5, 8, DEV)
    out = torch.full_like(q, float("nan"))
    decode_attention_fwd(
        q, *pool.buffers(0), out, table, inputs.req_pool_indices, inputs.seq_lens, 0.1, 4,
        workspace, counters, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    assert_close(out, ref, torch.bfloat16)
    assert not counters.any()


# every extend configuration the bench times, as extend_attention_fwd's keyword arguments
EXTEND_KWARGS = [
    dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st) for bm, bn, w, st in PACKED_CONFIGS
]


@pytest.mark.parametrize("kwargs", EXTEND_KWARGS, ids=lambda kw: "-".join(map(str, kw.values())))
def test_extend_configs(kwargs):
    extend_lens, prefix_lens = [1, 200, 129, 64], [0, 300, 0, 65]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool, table, inputs, q, k, v = make_batch(seq_lens, extend_lens, 32, 8, 128, torch.bfloat16)
    ref = reference(pool, table, inputs, q, k, v, 0.1)
    ext = inputs.extend_lens
    out = torch.full_like(q, float("nan"))
    extend_attention_fwd(
        q, *pool.buffers(0), out, table, inputs.req_pool_indices, inputs.seq_lens, ext,
        torch.cumsum(ext, 0) - ext, 200, 0.1, **kwargs,
    )  # fmt: skip
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("extend_lens", [(1, 1, 1), (1, 40, 3), (1, 1, 40)])
def test_backend_matches_reference(extend_lens):
    seq_lens = [1, 300, 90]
    pool, table, inputs, q, k, v = make_batch(seq_lens, list(extend_lens), 9, 3, 64, torch.float16)
    ref = reference(pool, table, inputs, q, k, v, 0.125)
    backend = TritonAttentionBackend(pool, table, BACKEND_KERNELS)
    backend.prepare(inputs)
    out = backend.forward(q, k, v, 0, 0.125)
    assert out.shape == (sum(extend_lens), 9 * 64)
    assert_close(out.view(q.shape), ref, torch.float16)


def test_decode_cuda_graph_replay_matches_eager():
    num_heads, num_kv_heads, head_dim, bs, scaling = 32, 8, 128, 8, 128**-0.5
    max_context = 1500
    pool, table, filled, _, _, _ = make_batch(
        [max_context] * bs, [1] * bs, num_heads, num_kv_heads, head_dim, torch.bfloat16
    )
    backend = TritonAttentionBackend(pool, table, BACKEND_KERNELS)
    backend.init_graph_buffers(16)
    static_q = torch.zeros(bs, num_heads, head_dim, dtype=torch.bfloat16, device=DEV)
    static_k = torch.zeros(bs, num_kv_heads, head_dim, dtype=torch.bfloat16, device=DEV)
    static_v = torch.zeros_like(static_k)

    backend.prepare_graph(bs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compiles and allocates the graph workspace
        backend.forward(static_q, static_k, static_v, 0, scaling)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.forward(static_q, static_k, static_v, 0, scaling)

    rng = random.Random(3)
    rows = filled.req_pool_indices.tolist()
    for n in (7, 8, 3):
        seq_lens = [1, *ragged(rng, n - 1, 2, max_context)]
        req_rows = rows[:n]
        loc = torch.stack([table[r, s - 1] for r, s in zip(req_rows, seq_lens)]).long()
        inputs = AttentionInputs(
            req_pool_indices=torch.tensor(req_rows, dtype=torch.int64, device=DEV),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=DEV),
            extend_lens=torch.ones(n, dtype=torch.int64, device=DEV),
            out_cache_loc=loc,
            seq_lens_cpu=tuple(seq_lens),
            extend_lens_cpu=(1,) * n,
        )
        q = torch.randn(n, num_heads, head_dim, device=DEV).bfloat16()
        k = torch.randn(n, num_kv_heads, head_dim, device=DEV).bfloat16()
        v = torch.randn_like(k)
        static_q[:n], static_k[:n], static_v[:n] = q, k, v
        backend.load_graph_inputs(inputs, bs)
        k_before = pool.k_buffers[0].clone()
        graph.replay()
        assert not backend._graph_counters.any(), "a replay left a split counter set"
        changed = (pool.k_buffers[0] != k_before).flatten(1).any(1).nonzero().flatten()
        allowed = {*loc.tolist(), pool.dummy_slot}
        assert set(changed.tolist()) <= allowed, "a padding row wrote a real KV slot"
        graph_out = static_out[:n].view(n, num_heads, head_dim).clone()

        # eager with the graph's split count: bit-identical
        splits = backend._num_kv_splits(bs)
        eager = decode(pool, table, inputs, q, splits, scaling)
        assert torch.equal(graph_out, eager)
        # the eager backend (its own split count) and the reference agree within bf16 bounds
        eager_backend = TritonAttentionBackend(pool, table, BACKEND_KERNELS)
        eager_backend.prepare(inputs)
        eager_out = eager_backend.forward(q, k, v, 0, scaling).view(q.shape)
        ref = reference(pool, table, inputs, q, k, v, scaling)
        assert_close(graph_out, ref, torch.bfloat16)
        assert_close(eager_out, ref, torch.bfloat16)
