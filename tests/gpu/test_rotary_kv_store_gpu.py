"""kernels/rotary_kv_store.py on CUDA: the one-launch rotary + KV store against the two kernels it
stands for (`apply_rotary_` then `store_kv`) bit for bit, and against the torch path within the
FMA bound of tests/gpu/test_fused_kernels.py's test_rotary; captured in a CUDA graph; launched
with PDL on Hopper; KVPool.store_rotated with the Triton kernels and without; and a tiny model's
greedy tokens and logits with the decode graphs' rotary inside the decode kernel
(kernels/decode_attention.py's DecodeRope) and with the rotary-store kernel before it.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qkv_layout import qkv_views  # noqa: E402

DEV = "cuda"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
NUM_POSITIONS = 4096


def _make_case(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """(qkv, positions, loc, k_buf, v_buf, rotary): loc out of order, the dummy slot among them."""
    from batchrun.layers.rotary import RotaryEmbedding

    gen = torch.Generator(device=DEV).manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width + 8, generator=gen, device=DEV).to(dtype)[:, :width]
    positions = torch.randint(0, NUM_POSITIONS, (num_tokens,), generator=gen, device=DEV)
    num_slots = 3 * num_tokens + 4
    loc = torch.randperm(num_slots, generator=gen, device=DEV)[: num_tokens - 1]
    loc = torch.cat([loc, torch.tensor([num_slots], device=DEV)])  # the dummy (last) slot
    buf_shape = (num_slots + 1, num_kv_heads, head_dim)
    k_buf = torch.randn(buf_shape, generator=gen, device=DEV).to(dtype)
    v_buf = torch.randn(buf_shape, generator=gen, device=DEV).to(dtype)
    rotary = RotaryEmbedding(head_dim, NUM_POSITIONS, 500000.0, {}, DEV)
    return qkv, positions, loc, k_buf, v_buf, rotary


def _two_kernels(qkv, positions, loc, k_buf, v_buf, rotary, heads):
    """(q, k_buf, v_buf) of apply_rotary_ then store_kv, on copies."""
    from batchrun.kernels.fused_rotary import apply_rotary_
    from batchrun.kernels.kv_store import store_kv

    q, k, v = qkv_views(qkv.clone(), *heads)
    k_buf, v_buf = k_buf.clone(), v_buf.clone()
    apply_rotary_(q, k, positions, rotary.cos_cache, rotary.sin_cache)
    store_kv(k_buf, v_buf, loc, k, v)
    return q, k_buf, v_buf


def _within_fma_bound(got, ref, x, head_dim) -> bool:
    """|got - ref| within two roundings of the products (an FMA may skip one, see test_rotary)."""
    eps = torch.finfo(x.dtype).eps
    bound = 2 * eps * (x.float().abs() + x.float().abs().roll(head_dim // 2, -1)) + 1e-30
    return bool(((got.float() - ref.float()).abs() <= bound).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 5, 300])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(32, 8, 128), (32, 8, 64), (8, 8, 64), (6, 3, 80)]
)
def test_matches_rotary_then_store(dtype, num_tokens, num_heads, num_kv_heads, head_dim):
    from batchrun.kernels.rotary_kv_store import rotary_store_kv

    from batchrun.layers.rotary import _apply_rotary

    heads = (num_heads, num_kv_heads, head_dim)
    qkv, positions, loc, k_buf, v_buf, rotary = _make_case(num_tokens, *heads, dtype)
    want_q, want_k_buf, want_v_buf = _two_kernels(qkv, positions, loc, k_buf, v_buf, rotary, heads)
    for loc_dtype in (torch.int64, torch.int32):
        qkv_one = qkv.clone()
        q, k, v = qkv_views(qkv_one, *heads)
        k_one, v_one = k_buf.clone(), v_buf.clone()
        rotary_store_kv(
            k_one, v_one, loc.to(loc_dtype), q, k, v, positions, rotary.cos_cache, rotary.sin_cache
        )
        assert torch.equal(q, want_q)
        assert torch.equal(k_one, want_k_buf) and torch.equal(v_one, want_v_buf)
        kv_cols = slice(num_heads * head_dim, None)
        assert torch.equal(qkv_one[:, kv_cols], qkv[:, kv_cols]), "k or v was written"
    # the torch path (RotaryEmbedding's formula), as the two kernels are held to it
    q0, k0, v0 = qkv_views(qkv, *heads)
    cos = rotary.cos_cache[positions].unsqueeze(1)
    sin = rotary.sin_cache[positions].unsqueeze(1)
    assert _within_fma_bound(q, _apply_rotary(q0, cos, sin), q0, head_dim)
    assert _within_fma_bound(k_one[loc], _apply_rotary(k0, cos, sin), k0, head_dim)
    assert torch.equal(v_one[loc], v0)


def test_cuda_graph_replays_with_new_inputs():
    """Captured once, replayed with new qkv / positions / loc in the same static tensors."""
    from batchrun.kernels.rotary_kv_store import rotary_store_kv

    heads = (32, 8, 128)
    qkv, positions, loc, k_buf, v_buf, rotary = _make_case(4, *heads, torch.bfloat16)
    q, k, v = qkv_views(qkv, *heads)
    cos, sin = rotary.cos_cache, rotary.sin_cache
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        rotary_store_kv(k_buf, v_buf, loc, q, k, v, positions, cos, sin)  # compile first
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rotary_store_kv(k_buf, v_buf, loc, q, k, v, positions, cos, sin)
    for seed in (1, 2):
        new_qkv, new_pos, new_loc, new_k_buf, new_v_buf, _ = _make_case(
            4, *heads, torch.bfloat16, seed
        )
        want = _two_kernels(new_qkv, new_pos, new_loc, new_k_buf, new_v_buf, rotary, heads)
        qkv.copy_(new_qkv)
        positions.copy_(new_pos)
        loc.copy_(new_loc)
        k_buf.copy_(new_k_buf)
        v_buf.copy_(new_v_buf)
        graph.replay()
        for got, expect in zip((q, k_buf, v_buf), want):
            assert torch.equal(got, expect), seed


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9, reason="needs sm_90+"
)
def test_launched_with_pdl():
    """With pdl=True the compiled kernel waits on the grid dependency (griddepcontrol.wait);
    with pdl=False it does not."""
    from batchrun.kernels.rotary_kv_store import _rotary_store_kv_kernel, rotary_store_kv

    heads = (32, 8, 64)
    for pdl in (True, False):
        qkv, positions, loc, k_buf, v_buf, rotary = _make_case(1, *heads, torch.bfloat16)
        q, k, v = qkv_views(qkv, *heads)
        cos, sin = rotary.cos_cache, rotary.sin_cache
        rotary_store_kv(k_buf, v_buf, loc, q, k, v, positions, cos, sin, pdl=pdl)
        torch.cuda.synchronize()
        kernels = [
            k for cache in _rotary_store_kv_kernel.device_caches.values() for k in cache[0].values()
        ]
        assert any(("griddepcontrol.wait" in k.asm["ptx"]) == pdl for k in kernels), pdl


@pytest.mark.parametrize("triton_ops", [True, False], ids=["triton", "torch"])
def test_kv_pool_store_rotated(monkeypatch, triton_ops):
    """KVPool.store_rotated with the Triton kernels runs kernels/rotary_kv_store.py once, with
    the bits of apply_rotary_ then store_kv; with the torch reference, rotary then index_put,
    within the FMA bound of the torch formula. Only the layer asked for is written."""
    from spies import count_calls

    import batchrun.engine.kv_pool as kv_pool
    from batchrun.config import KernelPlan
    from batchrun.layers.rotary import RotaryEmbedding

    calls = count_calls(monkeypatch, kv_pool, "rotary_store_kv")
    kernels = KernelPlan(triton_ops=True, pdl=False) if triton_ops else KernelPlan.reference()
    heads = (32, 8, 128)
    qkv, positions, loc, _, _, _ = _make_case(37, *heads, torch.bfloat16)
    rotary = RotaryEmbedding(128, NUM_POSITIONS, 500000.0, {}, DEV, kernels)
    pool = kv_pool.KVPool(2, 200, 8, 128, torch.bfloat16, DEV, kernels)
    empty = [torch.zeros_like(b) for b in pool.buffers(1)]
    want_q, want_k_buf, want_v_buf = _two_kernels(qkv, positions, loc, *empty, rotary, heads)
    q, k, v = qkv_views(qkv.clone(), *heads)
    q = pool.store_rotated(1, loc, q, k, v, positions, rotary)
    assert calls["n"] == (1 if triton_ops else 0)
    k_buf, v_buf = pool.buffers(1)
    assert torch.equal(v_buf, want_v_buf)
    if triton_ops:
        assert torch.equal(q, want_q)
        assert torch.equal(k_buf, want_k_buf)
    else:
        q0, k0, _ = qkv_views(qkv, *heads)
        assert _within_fma_bound(q, want_q, q0, 128)
        assert _within_fma_bound(k_buf[loc], want_k_buf[loc], k0, 128)
    assert not any(b.any() for b in pool.buffers(0)), "layer 0 was written"


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_dir(request, tmp_path_factory):
    from tiny_models import make_tiny_model

    path = tmp_path_factory.mktemp(request.param)
    make_tiny_model(request.param, path)
    return str(path)


def test_engine_same_tokens_with_the_decode_kernels_rotary_or_the_rotary_store(
    tiny_dir, monkeypatch
):
    """Decode graphs of up to DECODE_ROPE_MAX_BS rows rotate q and the new k inside the decode
    kernel and store the new KV there (DecodeRope); every other step rotates and stores in
    kernels/rotary_kv_store.py. Built with the decode kernel's own rotary turned off
    (TritonAttentionBackend._rotates_in_decode), the graphs run the rotary-store kernel then
    the plain decode kernel instead: greedy tokens (batches of 6 and of 1, one-row decodes
    through the fused decode) and logits are the same bits."""
    from spies import count_calls
    from tiny_models import random_prompts

    import batchrun.attention.triton_backend as triton_backend
    import batchrun.engine.kv_pool as kv_pool
    from batchrun.config import EngineConfig, KernelPlan
    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(6, seed=5, min_len=2, max_len=14)

    def run(decode_rope: bool):
        rope = count_calls(monkeypatch, triton_backend, "DecodeRope")
        store = count_calls(monkeypatch, kv_pool, "rotary_store_kv")
        if not decode_rope:
            monkeypatch.setattr(
                triton_backend.TritonAttentionBackend, "_rotates_in_decode", lambda *a: False
            )
        kernels = KernelPlan(attention="triton", cuda_graph_max_bs=16, piecewise_graphs=False)
        config = EngineConfig(model=tiny_dir, device="cuda", dtype="bfloat16", kv_budget=4096)
        engine = Engine(config, kernels)
        (alone,) = [
            r.output_ids for r in engine.generate([GenerateRequest("a", prompts[0], params)])
        ]
        reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
        outs = {r.rid: r.output_ids for r in engine.generate(reqs)}
        logits = engine.score(prompts[1] + alone[:2])  # <= 16 tokens: through attend
        engine.check_integrity()
        assert (rope["n"] > 0) == decode_rope, rope
        assert store["n"] > 0  # the prefills
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        monkeypatch.undo()
        return alone, outs, logits

    ref = run(False)
    got = run(True)
    assert got[0] == ref[0] and got[1] == ref[1]
    assert torch.equal(got[2], ref[2])
