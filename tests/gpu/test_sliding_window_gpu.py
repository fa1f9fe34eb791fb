"""Sliding-window attention on CUDA: the Triton decode and extend kernels with a window against
the torch reference with the window's mask (fp32), with NaN in the KV before each request's
window (a kernel that reads a block wholly outside it fails); the rope decode kernel with a
window, bit for bit against rotary_store_kv then the plain kernel; the Triton backend's decode
graphs with layers of two windows; and an engine run of windowed tiny
models (Mistral, every layer; Qwen2, some layers) with CUDA graphs and overlap, against the torch
backend's tokens.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from batchrun.kernels.extend_attention import extend_attention_fwd  # noqa: E402
from test_kernels import (  # noqa: E402
    BACKEND_KERNELS,
    DEV,
    assert_close,
    decode,
    make_batch,
    ragged,
)

from batchrun.attention.base import AttentionInputs  # noqa: E402
from batchrun.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from batchrun.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from batchrun.engine.kv_pool import KVPool  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BLOCK_N = 64  # the extend kernel's default KV block


def reference(pool, table, inputs, q, k, v, scaling, window):
    """The torch backend in fp32 with the window, over an fp32 copy of the pool; stores the new
    tokens' k / v in `pool` as the Triton backend does before its kernels."""
    num_kv_heads = pool.k_buffers[0].shape[1]
    ref_pool = KVPool(1, pool.num_slots, num_kv_heads, q.shape[2], torch.float32, DEV)
    ref_pool.k_buffers[0].copy_(pool.k_buffers[0])
    ref_pool.v_buffers[0].copy_(pool.v_buffers[0])
    backend = TorchAttentionBackend(ref_pool, table)
    backend.prepare(inputs)
    out = backend.forward(q.float(), k.float(), v.float(), 0, scaling, window=window)
    pool.store(0, inputs.out_cache_loc, k, v)
    return out.view(q.shape)


def poison(pool, table, inputs, unread) -> None:
    """NaN into request b's KV at positions [0, unread[b])."""
    for b, n in enumerate(unread):
        if n > 0:
            slots = table[inputs.req_pool_indices[b], :n].long()
            pool.k_buffers[0][slots] = float("nan")
            pool.v_buffers[0][slots] = float("nan")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("window", [1, 17, 64, 500, 4096])
@pytest.mark.parametrize("batch_size", [1, 7, 64], ids=["b1", "b7", "b64"])
def test_decode_with_window(batch_size, window, dtype):
    rng = random.Random(batch_size * 31 + window)
    seq_lens = [1777] if batch_size == 1 else [1, 33, *ragged(rng, batch_size - 2, 1, 1500)]
    pool, table, inputs, q, k, v = make_batch(seq_lens, [1] * batch_size, 32, 8, 128, dtype)
    ref = reference(pool, table, inputs, q, k, v, 128**-0.5, window)
    poison(pool, table, inputs, [s - window for s in seq_lens])
    for splits in (1, 5, 16):
        out = decode(pool, table, inputs, q, splits, 128**-0.5, window=window)
        assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("window", [1, 17, 64, 100, 500, 4096])
@pytest.mark.parametrize("heads", [(32, 8), (9, 3), (8, 8)], ids=["gqa32_8", "gqa9_3", "mha"])
def test_extend_with_window(heads, window, dtype):
    """Prefills and chunks over cached prefixes, the window shorter and longer than the query
    and KV blocks; no block before a request's first query's window is read."""
    prefix_lens, extend_lens = [0, 700, 3, 1200, 64], [333, 65, 129, 1, 200]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool, table, inputs, q, k, v = make_batch(seq_lens, extend_lens, *heads, 128, dtype)
    ref = reference(pool, table, inputs, q, k, v, 0.1, window)
    poison(pool, table, inputs, [max(p - window + 1, 0) // BLOCK_N * BLOCK_N for p in prefix_lens])
    ext = inputs.extend_lens
    out = torch.full_like(q, float("nan"))
    extend_attention_fwd(
        q, *pool.buffers(0), out, table, inputs.req_pool_indices, inputs.seq_lens, ext,
        torch.cumsum(ext, 0) - ext, max(extend_lens), 0.1, window=window,
    )  # fmt: skip
    assert_close(out, ref, dtype)


def test_rope_decode_with_window_matches_rotary_store_then_decode():
    from batchrun.kernels.decode_attention import DecodeRope
    from batchrun.kernels.rotary_kv_store import rotary_store_kv

    from batchrun.layers.rotary import RotaryEmbedding

    seq_lens = [1, 64, 65, 700, 1500, 33, 300, 1200]
    pool, table, inputs, q, k, v = make_batch(seq_lens, [1] * 8, 32, 8, 128, torch.bfloat16)
    rotary = RotaryEmbedding(128, 2048, 500000.0, {}, DEV)
    positions, loc = inputs.seq_lens - 1, inputs.out_cache_loc
    cos, sin = rotary.cos_cache, rotary.sin_cache
    for window in (1, 100, 4096):
        for splits in (1, 5, 16):
            pools = [tuple(b.clone() for b in pool.buffers(0)) for _ in range(2)]
            q_rot = q.clone()
            rotary_store_kv(*pools[0], loc, q_rot, k, v, positions, cos, sin)
            outs = []
            for query, bufs, rope in (
                (q_rot, pools[0], None),
                (q, pools[1], DecodeRope(k, v, loc, positions, cos, sin)),
            ):
                copy = KVPool(1, pool.num_slots, 8, 128, torch.bfloat16, DEV)
                copy.k_buffers[0].copy_(bufs[0])
                copy.v_buffers[0].copy_(bufs[1])
                outs.append(decode(copy, table, inputs, query, splits, 0.1, window=window,
                                   rope=rope))  # fmt: skip
                bufs[0].copy_(copy.k_buffers[0])
                bufs[1].copy_(copy.v_buffers[0])
            assert not outs[1].isnan().any()
            assert torch.equal(outs[1], outs[0]), (window, splits)
            assert torch.equal(pools[1][0], pools[0][0])


def test_triton_decode_graph_with_two_windows():
    """One decode graph capturing a global layer and a local one (window 48), replayed with new
    batches: each layer's output equals the eager backend's within bf16 bounds of the fp32
    reference with its window."""
    num_heads, num_kv_heads, head_dim, bs, scaling, max_context = 32, 8, 128, 8, 0.1, 1500
    pool, table, filled, _, _, _ = make_batch(
        [max_context] * bs, [1] * bs, num_heads, num_kv_heads, head_dim, torch.bfloat16
    )
    backend = TritonAttentionBackend(pool, table, BACKEND_KERNELS)
    backend.init_graph_buffers(16)
    static = [torch.zeros(bs, n, head_dim, dtype=torch.bfloat16, device=DEV)
              for n in (num_heads, num_kv_heads, num_kv_heads)]  # fmt: skip
    windows = (0, 48)
    backend.prepare_graph(bs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up
        for w in windows:
            backend.forward(*static, 0, scaling, window=w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [backend.forward(*static, 0, scaling, window=w).clone() for w in windows]

    rng = random.Random(5)
    rows = filled.req_pool_indices.tolist()
    for n in (7, 8, 3):
        seq_lens = [1, *ragged(rng, n - 1, 2, max_context)]
        loc = torch.stack([table[r, s - 1] for r, s in zip(rows[:n], seq_lens)]).long()
        inputs = AttentionInputs(
            req_pool_indices=torch.tensor(rows[:n], dtype=torch.int64, device=DEV),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=DEV),
            extend_lens=torch.ones(n, dtype=torch.int64, device=DEV),
            out_cache_loc=loc,
            seq_lens_cpu=tuple(seq_lens),
            extend_lens_cpu=(1,) * n,
        )
        for t in static:
            t[:n] = torch.randn(t[:n].shape, device=DEV).bfloat16()
        q, k, v = (t[:n].clone() for t in static)
        backend.load_graph_inputs(inputs, bs)
        graph.replay()
        for w, out in zip(windows, outs):
            ref = reference(pool, table, inputs, q, k, v, scaling, w)
            assert_close(out[:n].view(n, num_heads, head_dim), ref, torch.bfloat16)


@pytest.mark.parametrize("kind", ["mistral-window", "qwen2-window"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_engine_with_graphs_matches_torch(kind, overlap, tmp_path):
    """fp32 greedy tokens of a windowed tiny model, Triton attention with decode graphs (and
    piecewise graphs for prefill), against the torch backend eagerly."""
    from tiny_models import make_tiny_model, random_prompts

    from batchrun.config import EngineConfig, KernelPlan
    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    make_tiny_model(kind, tmp_path)
    params = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(24, seed=11, min_len=4, max_len=120)
    prompts = [prompts[0][:30] + p if i % 2 else p for i, p in enumerate(prompts)]

    def run(kernels, **kw):
        cfg = dict(model=str(tmp_path), device="cuda", dtype="float32", kv_budget=20000)
        engine = Engine(EngineConfig(**{**cfg, **kw}), kernels=KernelPlan(**kernels))
        reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
        out = {r.rid: r.output_ids for r in engine.generate(reqs)}
        engine.check_integrity()
        return out

    ref = run(dict(attention="torch", cuda_graph_max_bs=0), overlap=False)
    assert run(dict(attention="triton", cuda_graph_max_bs=32), overlap=overlap) == ref
