"""kernels/rotary_kv_store.py under Triton's CPU interpreter: the one-launch rotary + KV store
against the two kernels it replaces (`apply_rotary_` then `store_kv`) and the torch path, bit for
bit; `KVPool.store_rotated` with the Triton kernels against rotary + store; the Triton
backend's `forward_rotary` against rotary + forward (decode, extend and mixed plans); a tiny
model's tokens and logits on the one kernel against the two.

Skipped where triton is not installed. The kernels run in a subprocess because TRITON_INTERPRET
must be set before triton is first imported. The interpreter casts fp32 to bf16 by truncation
(the GPU rounds to nearest even), so bf16 is compared with the two kernels only (same casts on
both sides), not with torch; tests/gpu covers bf16 against torch.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # CI's slow tier (BATCHRUN_SLOW_TESTS=1)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from qkv_layout import qkv_views  # noqa: E402
from spies import count_calls  # noqa: E402
from triton_interpreter import INTERPRETER_KERNELS  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (T, H, KV, D): GQA, MHA, llama-1b's and llama-8b's heads, a D that is not a power of two
SHAPES = ((1, 8, 2, 64), (5, 8, 2, 128), (5, 4, 4, 64), (1, 32, 8, 64), (1, 32, 8, 128),
          (5, 6, 3, 80))  # fmt: skip
NUM_POSITIONS = 300


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_rotary_kv_store_under_interpreter():
    from triton_interpreter import run_under_interpreter

    run_under_interpreter(__file__)


def _make_case(shape, dtype, seed: int, kernels=None):
    """(qkv, positions, loc, k_buf, v_buf, rotary): loc out of order, the dummy slot among them;
    the rotary with `kernels` (the torch path by default)."""
    from batchrun.layers.rotary import RotaryEmbedding

    num_tokens, num_heads, num_kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    # NOTE: a padded row stride, so the token stride is not the heads' extent
    qkv = (torch.randn(num_tokens, width + 8, generator=gen) * 3).to(dtype)[:, :width]
    positions = torch.randint(0, NUM_POSITIONS, (num_tokens,), generator=gen)
    num_slots = 3 * num_tokens + 4
    loc = torch.randperm(num_slots, generator=gen)[: num_tokens - 1]
    loc = torch.cat([loc, torch.tensor([num_slots])])  # the dummy (last) slot
    buf_shape = (num_slots + 1, num_kv_heads, head_dim)
    k_buf = torch.randn(buf_shape, generator=gen).to(dtype)
    v_buf = torch.randn(buf_shape, generator=gen).to(dtype)
    rotary = RotaryEmbedding(head_dim, NUM_POSITIONS, 10000.0, {}, "cpu", kernels)
    return qkv, positions, loc, k_buf, v_buf, rotary


def _check_kernel(dtype) -> None:
    from batchrun.kernels.fused_rotary import apply_rotary_
    from batchrun.kernels.kv_store import store_kv
    from batchrun.kernels.rotary_kv_store import rotary_store_kv

    for seed, shape in enumerate(SHAPES):
        qkv, positions, loc, k_buf, v_buf, rotary = _make_case(shape, dtype, seed)
        cos, sin = rotary.cos_cache, rotary.sin_cache
        heads = shape[1:]
        # the two kernels
        qkv_two = qkv.clone()
        q2, k2, v2 = qkv_views(qkv_two, *heads)
        k_two, v_two = k_buf.clone(), v_buf.clone()
        apply_rotary_(q2, k2, positions, cos, sin)
        store_kv(k_two, v_two, loc, k2, v2)
        # torch: RotaryEmbedding's torch path and KVPool.store's index_put
        q0, k0, v0 = qkv_views(qkv, *heads)
        q_torch, k_torch = rotary(positions, q0, k0)
        k_torch_buf, v_torch_buf = k_buf.clone(), v_buf.clone()
        k_torch_buf[loc], v_torch_buf[loc] = k_torch, v0
        for loc_dtype in (torch.int64, torch.int32):
            qkv_one = qkv.clone()
            q1, k1, v1 = qkv_views(qkv_one, *heads)
            k_one, v_one = k_buf.clone(), v_buf.clone()
            rotary_store_kv(k_one, v_one, loc.to(loc_dtype), q1, k1, v1, positions, cos, sin)
            case = (dtype, shape, loc_dtype)
            assert torch.equal(q1, q2), ("q", case)
            assert torch.equal(k_one, k_two) and torch.equal(v_one, v_two), ("pool", case)
            # NOTE: k is read, not written (nobody reads it after the store); v is read only
            assert torch.equal(qkv_one[:, q1[0].numel() :], qkv[:, q1[0].numel() :]), case
            if dtype != torch.bfloat16:  # the interpreter's bf16 casts truncate
                assert torch.equal(q1, q_torch), ("q vs torch", case)
                assert torch.equal(k_one, k_torch_buf), ("k_buf vs torch", case)
                assert torch.equal(v_one, v_torch_buf), ("v_buf vs torch", case)


def _check_empty() -> None:
    from batchrun.kernels.rotary_kv_store import rotary_store_kv

    qkv, positions, loc, k_buf, v_buf, rotary = _make_case((1, 4, 2, 64), torch.float16, 0)
    q, k, v = qkv_views(qkv[:0], 4, 2, 64)
    k_before = k_buf.clone()
    cos, sin = rotary.cos_cache, rotary.sin_cache
    rotary_store_kv(k_buf, v_buf, loc[:0], q, k, v, positions[:0], cos, sin)
    assert torch.equal(k_buf, k_before)


def _store_rotated(shape, dtype, seed: int, pool_kernels, rotary_kernels):
    """(q, k_buf, v_buf) after KVPool.store_rotated, the pool and the rotary built with the
    given kernel configs."""
    from batchrun.engine.kv_pool import KVPool

    qkv, positions, loc, k_buf, v_buf, rotary = _make_case(shape, dtype, seed, rotary_kernels)
    pool = KVPool(2, k_buf.shape[0] - 1, shape[2], shape[3], dtype, "cpu", pool_kernels)
    pool.k_buffers[1].copy_(k_buf)
    pool.v_buffers[1].copy_(v_buf)
    q, k, v = qkv_views(qkv, *shape[1:])
    q = pool.store_rotated(1, loc, q, k, v, positions, rotary)
    return q, *pool.buffers(1)


def _check_pool(dtype) -> None:
    """store_rotated runs the one kernel where the pool and the rotary both have the Triton
    kernels; the same bits as the Triton rotary then torch's store (every dtype: a store is a
    copy), and as the torch path (fp32, fp16)."""
    import batchrun.engine.kv_pool as kv_pool
    from batchrun.config import KernelPlan

    shape, triton, torch_path = (5, 8, 2, 64), INTERPRETER_KERNELS, KernelPlan.reference()
    with pytest.MonkeyPatch.context() as mp:
        calls = count_calls(mp, kv_pool, "rotary_store_kv")
        fused = _store_rotated(shape, dtype, 3, triton, triton)
        assert calls["n"] == 1, "store_rotated did not use the kernel"
        rotary_apart = _store_rotated(shape, dtype, 3, torch_path, triton)
        reference = _store_rotated(shape, dtype, 3, torch_path, torch_path)
        assert calls["n"] == 1, "store_rotated used the kernel without the Triton store"
    for got, want in zip(fused, rotary_apart):
        assert torch.equal(got, want), dtype
    if dtype != torch.bfloat16:
        for got, want in zip(fused, reference):
            assert torch.equal(got, want), dtype


def _check_backend(dtype, make_backend) -> None:
    """backend.forward_rotary (one kernel for rotary + store) against rotary then forward (the
    Triton rotary, then the Triton store), for decode, extend and mixed plans: the same output
    and pool, bit for bit."""
    sys.path.insert(0, str(REPO / "tests" / "unit"))
    from test_kernels_interpreter import _make_batch

    from batchrun.layers.rotary import RotaryEmbedding

    num_heads, num_kv_heads, head_dim = 4, 2, 64
    rotary = RotaryEmbedding(head_dim, NUM_POSITIONS, 10000.0, {}, "cpu", INTERPRETER_KERNELS)
    plans = {
        "decode": ([9, 20, 4], [1, 1, 1]),
        "extend": ([12, 7], [5, 7]),
        "mixed": ([9, 20, 13], [1, 1, 6]),
    }
    for name, (seq_lens, extend_lens) in plans.items():
        outs = []
        for fused in (True, False):
            batch = _make_batch(
                seq_lens, extend_lens, num_heads, num_kv_heads, head_dim, dtype,
                INTERPRETER_KERNELS,
            )  # fmt: skip
            pool, table, inputs = batch[:3]
            width = (num_heads + 2 * num_kv_heads) * head_dim
            gen = torch.Generator().manual_seed(5)
            qkv = torch.randn(len(inputs.out_cache_loc), width, generator=gen).to(dtype)
            q, k, v = qkv_views(qkv, num_heads, num_kv_heads, head_dim)
            positions = torch.cat([torch.arange(s - e, s) for s, e in zip(seq_lens, extend_lens)])
            backend = make_backend(pool, table)
            backend.prepare(inputs)
            if fused:
                out = backend.forward_rotary(q, k, v, 0, 0.125, positions, rotary)
            else:
                q, k = rotary(positions, q, k)
                out = backend.forward(q, k, v, 0, 0.125)
            outs.append((out, *pool.buffers(0)))
        for got, want in zip(*outs):
            assert torch.equal(got, want), (name, dtype, type(backend).__name__)


def _triton_backend(pool, table):
    from batchrun.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(pool, table, INTERPRETER_KERNELS)


def _check_engine() -> None:
    """The tiny llama and qwen3 (q/k norm before rotary) on the Triton kernels and the Triton
    attention backend, fp16: every step's rotary and KV store run as the one kernel, and the
    greedy tokens and the logits equal those of the Triton rotary and store apart (the pool
    told that it cannot fuse them), bit for bit; the greedy tokens equal the torch path's and
    the logits are within fp16 rounding of them."""
    import tempfile

    from tiny_models import make_tiny_model

    from batchrun.config import KernelPlan

    with tempfile.TemporaryDirectory() as tmp_dir:
        for kind in ("llama", "qwen3"):
            path = Path(tmp_dir) / kind
            make_tiny_model(kind, path)
            fused, n_fused = _engine_run(path, INTERPRETER_KERNELS, fuse=True)
            apart, n_apart = _engine_run(path, INTERPRETER_KERNELS, fuse=False)
            reference, _ = _engine_run(path, KernelPlan.reference(), fuse=True)
            assert n_apart == 0 and n_fused > 0, (kind, n_apart, n_fused)
            assert fused[0] == apart[0], kind
            assert torch.equal(fused[1], apart[1]), kind
            assert fused[0] == reference[0], kind
            rel = ((fused[1] - reference[1]).norm() / reference[1].norm()).item()
            assert rel <= 5e-3, (kind, rel)


def _engine_run(path: Path, kernels, fuse: bool):
    """((greedy tokens, logits), calls of the one kernel) of an engine with `kernels`; with
    fuse False KVPool.fuses_rotary answers no, so store_rotated runs the rotary and the store
    apart."""
    from tiny_models import random_prompts

    import batchrun.engine.kv_pool as kv_pool
    from batchrun.config import EngineConfig
    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(3, seed=5, min_len=2, max_len=10)
    config = EngineConfig(model=str(path), device="cpu", dtype="float16", kv_budget=512)
    engine = Engine(config, kernels=kernels)
    assert engine.kernels.attention == kernels.attention
    assert engine.kernels.triton_ops == kernels.triton_ops
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    with pytest.MonkeyPatch.context() as mp:
        calls = count_calls(mp, kv_pool, "rotary_store_kv")
        if not fuse:
            mp.setattr(kv_pool.KVPool, "fuses_rotary", lambda self, *args: False)
        outs = {r.rid: r.output_ids for r in engine.generate(reqs)}
        logits = engine.score(prompts[1] + outs["0"][:2])  # <= 16 tokens: through attend
    return (outs, logits), calls["n"]


def _run_checks() -> None:
    for dtype in DTYPES:
        _check_kernel(dtype)
        _check_pool(dtype)
    _check_empty()
    # NOTE: the attention kernels' tl.dot is wrong for bf16 on the interpreter
    for dtype in (torch.float32, torch.float16):
        _check_backend(dtype, _triton_backend)
    _check_engine()
    print("ok")


if __name__ == "__main__":
    _run_checks()
