"""Fused RMSNorm / rotary / SiLU-and-mul / KV-store / argmax kernels against batchrun's torch code
on CUDA, and a tiny model's logits with the Triton kernels (KernelPlan.triton_ops) against the
torch reference (triton_ops=False).

Kernel outputs are NaN-filled first where the kernel writes a new tensor, so an element the kernel
forgets to write fails the test. Tolerances are in ulps of the torch result: the kernels round
where torch rounds, so the only differences come from fp32 reduction order, rsqrt and exp.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from batchrun.kernels.activation import silu_and_mul  # noqa: E402
from batchrun.kernels.fused_norm import fused_add_rms_norm, rms_norm  # noqa: E402
from batchrun.kernels.fused_rotary import apply_rotary_  # noqa: E402
from batchrun.kernels.kv_store import store_kv  # noqa: E402

from batchrun.config import KernelPlan  # noqa: E402
from batchrun.engine.kv_pool import KVPool  # noqa: E402
from batchrun.layers.norm import RMSNorm  # noqa: E402
from batchrun.layers.rotary import RotaryEmbedding, _apply_rotary  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_tiny_model, random_prompts  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = "cuda"
MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
MAX_ULPS = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 8}
# the blocks with the Triton kernels (launched without PDL: tests/gpu/test_pdl.py covers it)
TRITON = KernelPlan(triton_ops=True, pdl=False)


def max_ulps(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| in units of the last place of ref in ref's dtype."""
    ref32 = ref.float()
    exponent = torch.floor(torch.log2(ref32.abs().clamp_min(torch.finfo(ref.dtype).tiny)))
    ulp = torch.exp2(exponent - MANTISSA_BITS[ref.dtype])
    return ((out.float() - ref32).abs() / ulp).max().item()


def randn(*shape, dtype, seed=0, scale=3.0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)


def torch_rms_norm(x, weight, eps):
    """RMSNorm.forward's torch formula (layers/norm.py), written out here."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2048), (37, 576), (5, 4096), (3, 8192), (0, 64)])
def test_rms_norm(dtype, shape):
    num_rows, n_cols = shape
    x = randn(num_rows, n_cols + 8, dtype=dtype)[:, :n_cols]  # strided rows
    weight = randn(n_cols, dtype=dtype, seed=1, scale=1.0)
    out = torch.full((num_rows, n_cols), float("nan"), dtype=dtype, device=DEV)
    rms_norm(x, weight, 1e-6, out=out)
    ref = torch_rms_norm(x, weight, 1e-6)
    if num_rows:
        assert max_ulps(out, ref) <= MAX_ULPS[dtype], max_ulps(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,num_q,num_kv,head_dim", [(1, 32, 4, 128), (300, 64, 4, 128)])
def test_rms_norm_heads_has_the_bits_of_rms_norm(dtype, num_tokens, num_q, num_kv, head_dim):
    """Qwen3's q and k norms in one launch, in place on the qkv projection's heads (Qwen3-30B-A3B
    and Qwen3-235B-A22B's heads): the bits of rms_norm on each head copied out."""
    from batchrun.kernels.fused_norm import rms_norm_heads

    qkv = randn(num_tokens, (num_q + 2 * num_kv) * head_dim, dtype=dtype)
    wq = randn(head_dim, dtype=dtype, seed=1, scale=1.0)
    wk = randn(head_dim, dtype=dtype, seed=2, scale=1.0)
    q_end, k_end = num_q * head_dim, (num_q + num_kv) * head_dim
    want_q = rms_norm(qkv[:, :q_end].reshape(-1, head_dim), wq, 1e-6)
    want_k = rms_norm(qkv[:, q_end:k_end].reshape(-1, head_dim), wk, 1e-6)
    v = qkv[:, k_end:].clone()
    rms_norm_heads(qkv[:, :k_end].view(num_tokens, num_q + num_kv, head_dim), wq, wk, num_q, 1e-6)
    assert torch.equal(qkv[:, :q_end].reshape(-1, head_dim), want_q)
    assert torch.equal(qkv[:, q_end:k_end].reshape(-1, head_dim), want_k)
    assert torch.equal(qkv[:, k_end:], v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2048), (37, 576), (5, 4096)])
def test_fused_add_rms_norm(dtype, shape):
    x = randn(*shape, dtype=dtype)
    residual = randn(*shape, dtype=dtype, seed=2)
    weight = randn(shape[1], dtype=dtype, seed=1, scale=1.0)
    ref_residual = x + residual
    ref_x = torch_rms_norm(ref_residual, weight, 1e-5)
    fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, ref_residual)  # the add rounds exactly as torch's does
    assert max_ulps(x, ref_x) <= MAX_ULPS[dtype], max_ulps(x, ref_x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens,num_heads,num_kv_heads,head_dim",
    [(1, 32, 8, 64), (33, 32, 8, 128), (5, 9, 3, 64), (4, 16, 4, 256), (3, 6, 2, 80)],
)
def test_rotary(dtype, num_tokens, num_heads, num_kv_heads, head_dim):
    rotary = RotaryEmbedding(head_dim, 4096, 500000.0, {}, DEV)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, scale=1.0)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)  # strided views of qkv, as in llama.py
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v_before = v.clone()
    positions = torch.randint(0, 4096, (num_tokens,), device=DEV)
    cos = rotary.cos_cache[positions].unsqueeze(1)
    sin = rotary.sin_cache[positions].unsqueeze(1)
    ref_q, ref_k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
    # an FMA may contract x1 * c - x2 * s, skipping one rounding (sm_90 code does in bf16 where
    # contraction is on): allow two roundings of the products' size, which cancellation can make
    # large next to the result
    eps = torch.finfo(dtype).eps
    bound_q = 2 * eps * (q.float().abs() + q.float().abs().roll(head_dim // 2, -1)) + 1e-30
    bound_k = 2 * eps * (k.float().abs() + k.float().abs().roll(head_dim // 2, -1)) + 1e-30
    apply_rotary_(q, k, positions, rotary.cos_cache, rotary.sin_cache)
    assert torch.equal(v, v_before)
    assert ((q.float() - ref_q.float()).abs() <= bound_q).all()
    assert ((k.float() - ref_k.float()).abs() <= bound_k).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8192), (37, 576), (5, 14336), (0, 64)])
def test_silu_and_mul(dtype, shape):
    num_tokens, inter_size = shape
    x = randn(num_tokens, 2 * inter_size + 16, dtype=dtype)[:, : 2 * inter_size]
    out = torch.full((num_tokens, inter_size), float("nan"), dtype=dtype, device=DEV)
    silu_and_mul(x, out=out)
    gate, up = x.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    # fp32: Triton's fast exp in silu differs from torch's by up to ~13 ulps (1e-6 relative) on
    # the H200
    bound = 32 if dtype == torch.float32 else MAX_ULPS[dtype]
    if num_tokens:
        assert max_ulps(out, ref) <= bound, max_ulps(out, ref)


def test_rmsnorm_module_dispatch(monkeypatch):
    """The module path (reshape of a 3D strided q view, as Qwen3's q_norm sees): the Triton
    kernel with triton_ops on, within the kernel's ulps of the torch path with it off."""
    from spies import count_calls

    import batchrun.layers.norm as norm_module

    calls = count_calls(monkeypatch, norm_module, "rms_norm")
    weight = randn(64, dtype=torch.bfloat16, seed=1, scale=1.0)
    fused_norm, torch_norm = (
        RMSNorm(64, 1e-6, torch.bfloat16, DEV, kernels) for kernels in (TRITON, None)
    )
    for norm in (fused_norm, torch_norm):
        norm.weight.data.copy_(weight)
    qkv = randn(7, 3 * 4 * 64, dtype=torch.bfloat16)
    q = qkv[:, : 4 * 64].view(7, 4, 64)
    fused = fused_norm(q)
    assert calls["n"] == 1 and fused.shape == q.shape
    ref = torch_norm(q)
    assert calls["n"] == 1
    assert max_ulps(fused, ref) <= MAX_ULPS[torch.bfloat16]


def kv_views(num_tokens, num_kv_heads, head_dim, dtype, num_heads=4, seed=0):
    """k, v [T, KV, D] as strided views of a fused qkv tensor, as llama.py slices them."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, seed=seed)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    return k, v


def random_loc(num_tokens, num_slots, seed=0):
    """[T] distinct slots of [0, num_slots], the last (dummy) slot among them."""
    gen = torch.Generator().manual_seed(seed)
    loc = torch.randperm(num_slots, generator=gen)[: num_tokens - 1]
    return torch.cat([loc, torch.tensor([num_slots])]).to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 4096])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(8, 128), (8, 64), (3, 64), (1, 128)])
def test_store_kv(dtype, num_tokens, num_kv_heads, head_dim):
    num_slots = 2 * num_tokens + 5
    k, v = kv_views(num_tokens, num_kv_heads, head_dim, dtype)
    shape = (num_slots + 1, num_kv_heads, head_dim)
    k_buf, v_buf = randn(*shape, dtype=dtype, seed=1), randn(*shape, dtype=dtype, seed=2)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    loc = random_loc(num_tokens, num_slots, seed=num_tokens)
    k_ref[loc] = k  # the torch path of KVPool.store
    v_ref[loc] = v
    store_kv(k_buf, v_buf, loc.to(torch.int32) if num_tokens == 7 else loc, k, v)
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kv_pool_store_fused_vs_torch(dtype, monkeypatch):
    """KVPool.store with triton_ops (kernels/kv_store.py) and without (torch's index_put): the
    same pool, bit for bit."""
    from spies import count_calls

    import batchrun.engine.kv_pool as kv_pool

    calls = count_calls(monkeypatch, kv_pool, "store_kv")
    num_tokens, num_kv_heads, head_dim = 37, 8, 128
    pools = [
        KVPool(2, 100, num_kv_heads, head_dim, dtype, DEV, kernels) for kernels in (TRITON, None)
    ]
    k, v = kv_views(num_tokens, num_kv_heads, head_dim, dtype)
    loc = random_loc(num_tokens, 100)
    pools[0].store(1, loc, k, v)
    assert calls["n"] == 1, "KVPool.store did not use the kernel"
    pools[1].store(1, loc, k, v)
    assert calls["n"] == 1
    for layer_id in range(2):
        for fused, ref in zip(pools[0].buffers(layer_id), pools[1].buffers(layer_id)):
            assert torch.equal(fused, ref)


def test_store_kv_cuda_graph():
    """Captured once, replayed with new loc / k / v contents in the same static tensors."""
    dtype, num_tokens, num_kv_heads, head_dim, num_slots = torch.bfloat16, 16, 8, 128, 200
    qkv = torch.zeros(num_tokens, (4 + 2 * num_kv_heads) * head_dim, dtype=dtype, device=DEV)
    k = qkv[:, 4 * head_dim : (4 + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, -1)
    v = qkv[:, (4 + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    shape = (num_slots + 1, num_kv_heads, head_dim)
    k_buf = torch.zeros(shape, dtype=dtype, device=DEV)
    v_buf = torch.zeros(shape, dtype=dtype, device=DEV)
    loc = random_loc(num_tokens, num_slots)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        store_kv(k_buf, v_buf, loc, k, v)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_kv(k_buf, v_buf, loc, k, v)
    for seed in (1, 2):
        k_buf.zero_()
        v_buf.zero_()
        loc.copy_(random_loc(num_tokens, num_slots, seed=seed))
        qkv.copy_(randn(*qkv.shape, dtype=dtype, seed=seed))
        graph.replay()
        k_ref = torch.zeros_like(k_buf)
        v_ref = torch.zeros_like(v_buf)
        k_ref[loc] = k
        v_ref[loc] = v
        assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_model(request.param, path)
    return path


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 3e-2), ("float16", 5e-3)])
def test_model_logits_fused_vs_torch(tiny_dir, dtype, tol):
    """Teacher-forced logits of an engine with the defaults on CUDA (the Triton kernels, and
    kernels/gemv.py for prompts of up to 16 tokens in bf16 / fp16 where PDL is on) against one
    with triton_ops=False (torch's norms, rotary, KV store, gate and cuBLAS matmuls); both on
    the Triton attention."""
    from batchrun.config import EngineConfig
    from batchrun.engine.engine import Engine

    engines = [
        Engine(
            EngineConfig(model=str(tiny_dir), device="cuda", dtype=dtype, kv_budget=8192),
            kernels=KernelPlan(cuda_graph_max_bs=0, triton_ops=triton_ops),
        )
        for triton_ops in (None, False)
    ]
    assert engines[0].kernels.triton_ops and not engines[1].kernels.triton_ops
    assert engines[1].kernels.decode_gemv == "cublas"
    for prompt in random_prompts(3, seed=1, min_len=8, max_len=60):
        fused, ref = (engine.score(prompt) for engine in engines)
        rel = ((fused - ref).norm() / ref.norm()).item()
        assert rel <= tol, f"relative error {rel:.2e}"


@pytest.mark.parametrize("rows", [1, 3, 16, 256, 1000])
@pytest.mark.parametrize("vocab", [128256, 49152, 32000, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_kernel_matches_torch(rows, vocab, dtype):
    """kernels/argmax.py (the sampler's greedy ids at every batch size): torch's ids, ties
    included (bf16 logits of a random model have many)."""
    from batchrun.kernels.argmax import argmax

    g = torch.Generator(device="cuda").manual_seed(rows + vocab)
    logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 4).round().to(dtype)
    assert torch.equal(argmax(logits), logits.argmax(dim=-1))
    strided = torch.randn(rows, vocab + 64, device="cuda", generator=g).to(dtype)[:, :vocab]
    assert torch.equal(argmax(strided), strided.argmax(dim=-1))


@pytest.mark.parametrize("triton_ops", [True, False], ids=["triton-argmax", "torch-argmax"])
def test_sampler_greedy_banned_on_cuda(triton_ops):
    """A greedy batch with banned ids (min_new_tokens) on bf16 CUDA logits, with the Triton
    argmax and with torch's: the argmax of the masked logits, and the logits as they came (the
    ids are -inf only for the argmax)."""
    from batchrun.engine.sampler import Sampler, SamplingBatch
    from batchrun.params import SamplingParams

    rows, vocab, eos = 256, 128256, 128001
    g = torch.Generator(device="cuda").manual_seed(7)
    with torch.inference_mode():  # as a CUDA graph's logits are
        logits = torch.randn(rows, vocab, device="cuda", generator=g).to(torch.bfloat16)
        logits[::2, eos] = 50.0  # the ban decides these rows
    params = SamplingParams(temperature=0.0, min_new_tokens=4, stop_token_ids=(7,))
    steps = [i % 6 for i in range(rows)]  # rows at step >= 4 are past their min_new_tokens
    batch = SamplingBatch.build(
        [params] * rows, list(range(rows)), steps, list(range(rows)), vocab, [eos], "cuda"
    )
    before = logits.clone()
    kernels = TRITON if triton_ops else KernelPlan.reference()
    ids = Sampler(kernels)(logits, batch, None).next_token_ids
    masked = logits.clone()
    banned = torch.tensor([s < 4 for s in steps], device="cuda")
    masked[banned, eos] = float("-inf")
    masked[banned, 7] = float("-inf")
    assert torch.equal(ids, masked.argmax(dim=-1))
    assert torch.equal(logits, before)
