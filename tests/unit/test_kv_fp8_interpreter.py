"""The FP8 KV cache's Triton kernels under Triton's CPU interpreter: the stores
(kernels/kv_store.py, kernels/rotary_kv_store.py, the decode kernel's own store) against the torch
path's quantization bit for bit, and the decode and extend kernels reading a float8_e4m3fn pool
against the torch backend over an fp32 pool that holds the dequantized values.

Skipped where triton is not installed. The kernels run in a subprocess because TRITON_INTERPRET
must be set before triton is first imported. The interpreter's own float32 -> e4m3 cast rounds
half up and drops the carry into the exponent; kv_store.quantize_e4m3 rounds in float32
arithmetic before the cast (see there), so its bits are the GPU's and torch's here too. As in
test_kernels_interpreter.py, attention runs in fp32 and fp16 (the interpreter's tl.dot is wrong
for bf16), and rotation in fp32 and fp16 (its bf16 casts truncate); a bf16 store is exact here
(bf16 -> fp32 is). tests/gpu/test_kv_fp8_gpu.py covers bf16 on the GPU.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # CI's slow tier (BATCHRUN_SLOW_TESTS=1)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from qkv_layout import qkv_views  # noqa: E402
from triton_interpreter import INTERPRETER_KERNELS  # noqa: E402

FP8 = torch.float8_e4m3fn
# scales that are not powers of two, so x * (1 / scale) rounds; k's makes values clamp at 448
SCALES = ((0.37, 2.5), (1.0, 1.0), (0.0125, 0.025))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_kv_fp8_kernels_under_interpreter():
    from triton_interpreter import run_under_interpreter

    run_under_interpreter(__file__)


def _scale(k: float, v: float):
    from batchrun.quant.kv_cache import KVScale

    return KVScale(float(torch.tensor(k)), float(torch.tensor(v)))


def _pools(num_slots, num_kv_heads, head_dim, scale, kernels):
    """(Triton-store pool, torch-store pool), float8, one layer, the same random contents."""
    from batchrun.engine.kv_pool import KVPool
    from batchrun.quant.kv_cache import quantize_kv

    gen = torch.Generator().manual_seed(1)
    pools = [
        KVPool(1, num_slots, num_kv_heads, head_dim, FP8, "cpu", kern, [scale])
        for kern in (kernels, None)
    ]
    shape = pools[0].k_buffers[0].shape
    for buf, inv in ((0, scale.inv_k), (1, scale.inv_v)):
        data = quantize_kv(torch.randn(shape, generator=gen) * 4, inv)
        for pool in pools:
            pool.buffers(0)[buf].copy_(data)
    return pools


def _check_store(dtype) -> None:
    """KVPool.store on kernels/kv_store.py against its torch path: the same bits (strided k and v
    views of a qkv row, values beyond +-448 * scale among them, the dummy slot written)."""
    gen = torch.Generator().manual_seed(0)
    for k_scale, v_scale in SCALES:
        scale = _scale(k_scale, v_scale)
        for num_tokens, heads, kv_heads, head_dim in ((1, 8, 2, 64), (7, 8, 8, 128), (5, 6, 3, 80)):
            width = (heads + 2 * kv_heads) * head_dim
            qkv = (torch.randn(num_tokens, width + 8, generator=gen) * 60).to(dtype)[:, :width]
            qkv[0, -1] = -0.0  # the sign of zero is kept
            _, k, v = qkv_views(qkv, heads, kv_heads, head_dim)
            pools = _pools(3 * num_tokens + 2, kv_heads, head_dim, scale, INTERPRETER_KERNELS)
            loc = torch.randperm(pools[0].num_slots, generator=gen)[: num_tokens - 1]
            loc = torch.cat([loc, torch.tensor([pools[0].dummy_slot])])
            assert pools[0]._stores_in_triton(0, loc, k, v)
            assert not pools[1]._stores_in_triton(0, loc, k, v)
            for loc_dtype in (torch.int64, torch.int32):
                for pool in pools:
                    pool.store(0, loc.to(loc_dtype), k, v)
                for a, b in zip(pools[0].buffers(0), pools[1].buffers(0)):
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (dtype, scale)


def _check_store_rotated(dtype) -> None:
    """KVPool.store_rotated on kernels/rotary_kv_store.py against rotary then the torch store:
    the same q and the same pool bits."""
    from batchrun.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(2)
    scale = _scale(*SCALES[0])
    for num_tokens, heads, kv_heads, head_dim in ((1, 32, 8, 128), (5, 8, 2, 64)):
        width = (heads + 2 * kv_heads) * head_dim
        qkv = (torch.randn(num_tokens, width, generator=gen) * 60).to(dtype)
        positions = torch.randint(0, 200, (num_tokens,), generator=gen)
        pools = _pools(2 * num_tokens + 1, kv_heads, head_dim, scale, INTERPRETER_KERNELS)
        loc = torch.randperm(pools[0].num_slots, generator=gen)[:num_tokens]
        qs = []
        for pool, kernels in zip(pools, (INTERPRETER_KERNELS, None)):
            rotary = RotaryEmbedding(head_dim, 256, 10000.0, {}, "cpu", kernels)
            q, k, v = qkv_views(qkv.clone(), heads, kv_heads, head_dim)
            assert pool.fuses_rotary(0, loc, q, k, v, positions, rotary) == (kernels is not None)
            qs.append(pool.store_rotated(0, loc, q, k, v, positions, rotary))
        assert torch.equal(qs[0], qs[1])
        for a, b in zip(pools[0].buffers(0), pools[1].buffers(0)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), dtype


def _make_batch(seq_lens, extend_lens, num_heads, num_kv_heads, head_dim, dtype, scale):
    """(fp8 pool, fp32 reference pool holding its dequantized values, req_to_token, inputs, q,
    k, v), the requests in table rows out of order and their KV in shuffled slots."""
    from batchrun.attention.base import AttentionInputs
    from batchrun.engine.kv_pool import KVPool

    gen = torch.Generator().manual_seed(0)
    num_slots = sum(seq_lens) + 5
    pool, _ = _pools(num_slots, num_kv_heads, head_dim, scale, INTERPRETER_KERNELS)
    ref = KVPool(1, num_slots, num_kv_heads, head_dim, torch.float32, "cpu")
    ref.k_buffers[0].copy_(pool.k_buffers[0].float() * scale.k)
    ref.v_buffers[0].copy_(pool.v_buffers[0].float() * scale.v)
    table = torch.zeros(len(seq_lens) + 2, max(seq_lens) + 3, dtype=torch.int32)
    perm = torch.randperm(num_slots, generator=gen)
    rows = [2, 0, 3][: len(seq_lens)]
    locs, start = [], 0
    for row, seq_len, ext in zip(rows, seq_lens, extend_lens):
        table[row, :seq_len] = perm[start : start + seq_len].int()
        locs.append(perm[start + seq_len - ext : start + seq_len])
        start += seq_len
    num_tokens = sum(extend_lens)
    q, k, v = (
        (torch.randn(num_tokens, n, head_dim, generator=gen) * 2).to(dtype)
        for n in (num_heads, num_kv_heads, num_kv_heads)
    )
    inputs = AttentionInputs(
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq_lens),
        extend_lens=torch.tensor(extend_lens),
        out_cache_loc=torch.cat(locs).long(),
        seq_lens_cpu=tuple(seq_lens),
        extend_lens_cpu=tuple(extend_lens),
    )
    return pool, ref, table, inputs, q, k, v


def _reference(pool, ref, table, inputs, q, k, v, scaling):
    """The torch backend in fp32 over the dequantized pool, after the new tokens' KV is stored
    into `pool` (quantized) and its dequantized value into `ref`."""
    from batchrun.attention.torch_backend import TorchAttentionBackend

    pool.store(0, inputs.out_cache_loc, k, v)
    scale = pool.scales(0)
    loc = inputs.out_cache_loc
    ref.k_buffers[0][loc] = pool.k_buffers[0][loc].float() * scale.k
    ref.v_buffers[0][loc] = pool.v_buffers[0][loc].float() * scale.v
    backend = TorchAttentionBackend(ref, table)
    backend.prepare(inputs)
    # the new tokens are in `ref` already: store them again as they are
    return backend.forward(q.float(), ref.k_buffers[0][loc], ref.v_buffers[0][loc], 0, scaling)


def _check(out, ref, tol, what):
    out = out.reshape(ref.shape)
    assert not out.isnan().any(), ("unwritten output", what)
    err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
    assert err <= tol, (err, what)


def _check_decode(dtype, tol) -> None:
    """The decode kernel on a float8 pool, 1-4 splits, against the fp32 reference; the
    backend's forward (which stores first) too. Then DecodeRope on a float8 pool against
    rotary_store_kv then the plain kernel: the same output and pool bits."""
    from batchrun.kernels.decode_attention import (
        DecodeRope,
        decode_attention_fwd,
        decode_counters,
        decode_workspace_numel,
    )
    from batchrun.kernels.rotary_kv_store import rotary_store_kv

    from batchrun.attention.triton_backend import TritonAttentionBackend
    from batchrun.layers.rotary import RotaryEmbedding

    seq_lens = [1, 37, 70]
    for k_scale, v_scale in SCALES:
        scale = _scale(k_scale, v_scale)
        pool, ref_pool, table, inputs, q, k, v = _make_batch(
            seq_lens, [1, 1, 1], 6, 2, 32, dtype, scale
        )
        ref = _reference(pool, ref_pool, table, inputs, q, k, v, 0.2)
        counters = decode_counters(3, 2, "cpu")
        for splits in (1, 2, 3, 4):
            out = torch.full_like(q, float("nan"))
            workspace = torch.empty(decode_workspace_numel(3, 6, 32, splits))
            decode_attention_fwd(
                q, *pool.buffers(0), out, table, inputs.req_pool_indices, inputs.seq_lens, 0.2,
                splits, workspace, counters, kv_scale=scale, block_n=16,
            )  # fmt: skip
            _check(out, ref, tol, ("decode", dtype, scale, splits))
            assert not counters.any()
        run_pool = _make_batch(seq_lens, [1, 1, 1], 6, 2, 32, dtype, scale)[0]
        backend = TritonAttentionBackend(run_pool, table, INTERPRETER_KERNELS)
        backend.prepare(inputs)
        _check(backend.forward(q, k, v, 0, 0.2), ref, tol, ("backend decode", dtype, scale))

    rotary = RotaryEmbedding(32, 256, 10000.0, {}, "cpu", INTERPRETER_KERNELS)
    cos, sin = rotary.cos_cache, rotary.sin_cache
    scale = _scale(*SCALES[0])
    pool, _, table, inputs, q, k, v = _make_batch(seq_lens, [1, 1, 1], 6, 2, 32, dtype, scale)
    positions, loc = inputs.seq_lens - 1, inputs.out_cache_loc
    counters = decode_counters(3, 2, "cpu")
    inv = {"k_inv_scale": scale.inv_k, "v_inv_scale": scale.inv_v}
    for splits in (1, 2, 4):
        bufs = [tuple(b.clone() for b in pool.buffers(0)) for _ in range(2)]
        outs = [torch.full_like(q, float("nan")) for _ in range(2)]
        workspace = torch.empty(decode_workspace_numel(3, 6, 32, splits))
        q_rot = q.clone()
        rotary_store_kv(*bufs[0], loc, q_rot, k, v, positions, cos, sin, **inv)
        for i, (query, rope) in enumerate(
            ((q_rot, None), (q, DecodeRope(k, v, loc, positions, cos, sin)))
        ):
            decode_attention_fwd(
                query, *bufs[i], outs[i], table, inputs.req_pool_indices, inputs.seq_lens,
                0.2, splits, workspace, counters, rope=rope, kv_scale=scale, block_n=16,
            )  # fmt: skip
        assert torch.equal(outs[1], outs[0]), splits
        for a, b in zip(bufs[0], bufs[1]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), splits


def _check_extend(dtype, tol) -> None:
    """The extend kernel on a float8 pool against the fp32 reference (a cached prefix, a prompt
    from scratch, one token); the backend's mixed plan (decodes first) too."""
    from batchrun.kernels.extend_attention import extend_attention_fwd

    from batchrun.attention.triton_backend import TritonAttentionBackend

    for k_scale, v_scale in SCALES:
        scale = _scale(k_scale, v_scale)
        for seq_lens, ext in (([40, 19, 70], [23, 19, 1]), ([1, 1, 50], [1, 1, 50])):
            pool, ref_pool, table, inputs, q, k, v = _make_batch(seq_lens, ext, 8, 2, 32, dtype,
                                                                 scale)  # fmt: skip
            ref = _reference(pool, ref_pool, table, inputs, q, k, v, 0.3)
            start = torch.cumsum(inputs.extend_lens, 0) - inputs.extend_lens
            out = torch.full_like(q, float("nan"))
            extend_attention_fwd(
                q, *pool.buffers(0), out, table, inputs.req_pool_indices, inputs.seq_lens,
                inputs.extend_lens, start, max(ext), 0.3, kv_scale=scale, block_n=16,
            )  # fmt: skip
            _check(out, ref, tol, ("extend", dtype, scale, seq_lens))
            run_pool = _make_batch(seq_lens, ext, 8, 2, 32, dtype, scale)[0]
            backend = TritonAttentionBackend(run_pool, table, INTERPRETER_KERNELS)
            backend.prepare(inputs)
            _check(backend.forward(q, k, v, 0, 0.3), ref, tol, ("backend", dtype, seq_lens))


def _check_engine() -> None:
    """A tiny model with the FP8 KV cache: the Triton kernels (stores, decode, extend) give
    the torch path's greedy tokens and, within fp32 rounding, its logits."""
    import tempfile

    from tiny_models import make_tiny_model, random_prompts

    from batchrun.config import EngineConfig, KernelPlan
    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_model("llama", Path(tmp))
        prompts = random_prompts(3, seed=3)
        params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
        results = []
        for kernels in (INTERPRETER_KERNELS, KernelPlan.reference()):
            cfg = EngineConfig(
                model=tmp, device="cpu", dtype="float32", kv_budget=1024,
                kv_cache_dtype="fp8_e4m3",
            )  # fmt: skip
            engine = Engine(cfg, kernels=replace(kernels, cuda_graph_max_bs=0))
            reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
            tokens = {r.rid: r.output_ids for r in engine.generate(reqs)}
            results.append((tokens, engine.score(prompts[0])))
        assert results[0][0] == results[1][0]
        _check(results[0][1], results[1][1], 1e-4, "engine logits")


def _run_checks() -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        _check_store(dtype)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 4e-3)):
        _check_store_rotated(dtype)
        _check_decode(dtype, tol)
        _check_extend(dtype, tol)
    # bf16 queries: the decode's dots on fp16 operands (FP8_FP16_DOT; the interpreter's tl.dot
    # is wrong on bf16 operands, right on fp16)
    _check_decode(torch.bfloat16, 1e-2)
    _check_engine()
    print("ok")


if __name__ == "__main__":
    _run_checks()
