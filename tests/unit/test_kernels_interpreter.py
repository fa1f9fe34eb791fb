"""The Triton attention kernels under Triton's CPU interpreter, against the torch backend.

Skipped where triton is not installed (CI does not install it). The kernels run in a subprocess
because TRITON_INTERPRET must be set before triton is first imported. The interpreter's tl.dot
is wrong for bf16 inputs (a triton limitation), so only fp32 and fp16 run here; tests/gpu covers
bf16 on the GPU.
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
from triton_interpreter import INTERPRETER_KERNELS  # noqa: E402


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_kernels_under_interpreter():
    from triton_interpreter import run_under_interpreter

    run_under_interpreter(__file__)


def _make_batch(seq_lens, extend_lens, num_heads, num_kv_heads, head_dim, dtype, kernels=None):
    """(pool, req_to_token, inputs, q, k, v): a random pool (stores with `kernels`' KV store,
    torch's by default) and one new token per extend position, the requests in table rows out
    of order and their KV in shuffled slots."""
    from batchrun.attention.base import AttentionInputs
    from batchrun.engine.kv_pool import KVPool

    gen = torch.Generator().manual_seed(0)
    num_slots = sum(seq_lens) + 5
    pool = KVPool(1, num_slots, num_kv_heads, head_dim, dtype, "cpu", kernels)
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=gen))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=gen))
    table = torch.zeros(len(seq_lens) + 2, max(seq_lens) + 3, dtype=torch.int32)
    perm = torch.randperm(num_slots, generator=gen)
    rows = [2, 0, 3][: len(seq_lens)]
    locs, start = [], 0
    for row, seq_len, ext in zip(rows, seq_lens, extend_lens):
        table[row, :seq_len] = perm[start : start + seq_len].int()
        locs.append(perm[start + seq_len - ext : start + seq_len])
        start += seq_len
    num_tokens = sum(extend_lens)
    qkv = [
        torch.randn(num_tokens, n, head_dim, generator=gen).to(dtype)
        for n in (num_heads, num_kv_heads, num_kv_heads)
    ]
    inputs = AttentionInputs(
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq_lens),
        extend_lens=torch.tensor(extend_lens),
        out_cache_loc=torch.cat(locs).long(),
        seq_lens_cpu=tuple(seq_lens),
        extend_lens_cpu=tuple(extend_lens),
    )
    return pool, table, inputs, *qkv


def _reference(pool, table, inputs, q, k, v, scaling):
    from batchrun.attention.torch_backend import TorchAttentionBackend
    from batchrun.engine.kv_pool import KVPool

    num_kv_heads, head_dim = pool.k_buffers[0].shape[1:]
    ref_pool = KVPool(1, pool.num_slots, num_kv_heads, head_dim, torch.float32, "cpu")
    ref_pool.k_buffers[0].copy_(pool.k_buffers[0])
    ref_pool.v_buffers[0].copy_(pool.v_buffers[0])
    backend = TorchAttentionBackend(ref_pool, table)
    backend.prepare(inputs)
    out = backend.forward(q.float(), k.float(), v.float(), 0, scaling).view(q.shape)
    pool.store(0, inputs.out_cache_loc, k, v)
    return out


def _check(out, ref, tol):
    assert not out.isnan().any(), "unwritten output"
    err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
    assert err <= tol, err


def _decode(pool, table, inputs, q, splits, counters, workspace=None, **kwargs):
    from batchrun.kernels.decode_attention import decode_attention_fwd, decode_workspace_numel

    if workspace is None:
        workspace = torch.full((decode_workspace_numel(*q.shape[:2], 32, splits),), float("nan"))
    out = torch.full_like(q, float("nan"))
    decode_attention_fwd(
        q, *pool.buffers(0), out, table, inputs.req_pool_indices, inputs.seq_lens, 0.2, splits,
        workspace, counters, block_n=16, **kwargs,
    )  # fmt: skip
    return out


def _check_decode(dtype, tol) -> None:
    """The decode kernel against the torch backend for 1-4 KV splits (the last split program
    combines them, inside the same launch), and its split counters: every call leaves them
    zero, and the combine does not depend on which split program comes last."""
    from batchrun.kernels.decode_attention import decode_counters, decode_workspace_numel

    # block_n 16 and 4 splits: request 1 fills split 0 only, 37 splits 0-2, 70 splits 0-2
    seq_lens = [1, 37, 70]
    pool, table, inputs, q, k, v = _make_batch(seq_lens, [1, 1, 1], 6, 2, 32, dtype)
    ref = _reference(pool, table, inputs, q, k, v, 0.2)
    counters = decode_counters(3, 2, "cpu")
    for splits in (1, 2, 3, 4):
        out = _decode(pool, table, inputs, q, splits, counters)
        _check(out, ref, tol)
        assert not counters.any(), counters
        # again on the same counters (the combining program reset them): the same bits
        assert torch.equal(_decode(pool, table, inputs, q, splits, counters), out), splits
        assert not counters.any(), counters
    # the interpreter runs split S - 1 last; a counter that starts at 1 makes split S - 2 the
    # combiner instead (split S - 1's partial is in the workspace from the first call on it):
    # the same bits, because the combine reads every split from memory in split order
    workspace = torch.empty(decode_workspace_numel(3, 6, 32, 4))
    _decode(pool, table, inputs, q, 4, counters, workspace)
    counters.fill_(1)
    assert torch.equal(_decode(pool, table, inputs, q, 4, counters, workspace), out)


def _check_decode_rope(dtype) -> None:
    """The decode kernel that rotates q and the new k itself and stores the new k and v
    (DecodeRope) against kernels/rotary_kv_store.py then the plain decode kernel: the same
    output and the same pool, bit for bit, for 1, 2 and 4 splits. Then the backend's
    forward_rotary: a CUDA-graph decode plan of at most DECODE_ROPE_MAX_BS rows takes the
    kernel's own rotary and store; an eager plan, and a graph plan whose pool stores with torch
    (triton_ops off), rotate apart; all three give the same output and pool."""
    from batchrun.kernels.decode_attention import (
        DecodeRope,
        decode_attention_fwd,
        decode_counters,
        decode_workspace_numel,
    )
    from batchrun.kernels.rotary_kv_store import rotary_store_kv

    from batchrun.attention.triton_backend import DECODE_ROPE_MAX_BS, TritonAttentionBackend
    from batchrun.layers.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(32, 256, 10000.0, {}, "cpu", INTERPRETER_KERNELS)
    cos, sin = rotary.cos_cache, rotary.sin_cache
    seq_lens = [1, 37, 70]
    pool, table, inputs, q, k, v = _make_batch(seq_lens, [1, 1, 1], 6, 2, 32, dtype)
    positions = inputs.seq_lens - 1
    loc = inputs.out_cache_loc
    counters = decode_counters(3, 2, "cpu")
    for splits in (1, 2, 4):
        bufs = [tuple(b.clone() for b in pool.buffers(0)) for _ in range(2)]
        outs = [torch.full_like(q, float("nan")) for _ in range(2)]
        workspace = torch.empty(decode_workspace_numel(3, 6, 32, splits))
        q_rot = q.clone()
        rotary_store_kv(*bufs[0], loc, q_rot, k, v, positions, cos, sin)
        for i, (query, rope) in enumerate(
            ((q_rot, None), (q, DecodeRope(k, v, loc, positions, cos, sin)))
        ):
            decode_attention_fwd(
                query, *bufs[i], outs[i], table, inputs.req_pool_indices, inputs.seq_lens,
                0.2, splits, workspace, counters, rope=rope, block_n=16,
            )  # fmt: skip
        assert torch.equal(outs[1], outs[0]), splits
        assert torch.equal(bufs[1][0], bufs[0][0]) and torch.equal(bufs[1][1], bufs[0][1])
        assert not counters.any()

    assert len(seq_lens) <= DECODE_ROPE_MAX_BS
    results = []
    for graph, triton_ops in ((True, True), (False, True), (True, False)):
        kernels = replace(INTERPRETER_KERNELS, triton_ops=triton_ops)
        run_pool = _make_batch(seq_lens, [1, 1, 1], 6, 2, 32, dtype, kernels)[0]
        backend = TritonAttentionBackend(run_pool, table, kernels)
        run_rotary = RotaryEmbedding(32, 256, 10000.0, {}, "cpu", kernels)
        if graph:
            backend.init_graph_buffers(4)
            backend.prepare_graph(3)
            backend.load_graph_inputs(inputs, 3)
        else:
            backend.prepare(inputs)
        args = (0, loc, q, k, v, positions, run_rotary)
        assert backend._rotates_in_decode(*args) == (graph and triton_ops), (graph, triton_ops)
        out = backend.forward_rotary(q.clone(), k.clone(), v, 0, 0.2, positions, run_rotary)
        results.append((out, *run_pool.buffers(0)))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def _run_checks() -> None:
    from batchrun.kernels.extend_attention import extend_attention_fwd

    from batchrun.attention.triton_backend import TritonAttentionBackend

    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 4e-3)):
        _check_decode(dtype, tol)
        _check_decode_rope(dtype)

        extend_lens, prefix_lens = [1, 20, 40], [0, 17, 30]
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        pool, table, inputs, q, k, v = _make_batch(seq_lens, extend_lens, 6, 2, 32, dtype)
        ref = _reference(pool, table, inputs, q, k, v, 0.2)
        ext = inputs.extend_lens
        # GQA 6 / 2: a program holds a KV head's 3 query heads padded to 4 (16 or 64 query rows)
        for block_m in (4, 16):
            out = torch.full_like(q, float("nan"))
            extend_attention_fwd(
                q, *pool.buffers(0), out, table, inputs.req_pool_indices, inputs.seq_lens, ext,
                torch.cumsum(ext, 0) - ext, max(extend_lens), 0.2, block_m=block_m, block_n=16,
            )  # fmt: skip
            _check(out, ref, tol)
        # no GQA (4 / 4): one query head a program
        pool, table, inputs, q, k, v = _make_batch(seq_lens, extend_lens, 4, 4, 32, dtype)
        ref = _reference(pool, table, inputs, q, k, v, 0.2)
        out = torch.full_like(q, float("nan"))
        extend_attention_fwd(
            q, *pool.buffers(0), out, table, inputs.req_pool_indices, inputs.seq_lens,
            inputs.extend_lens, torch.cumsum(inputs.extend_lens, 0) - inputs.extend_lens,
            max(extend_lens), 0.2, block_n=16,
        )  # fmt: skip
        _check(out, ref, tol)

        # a mixed step through the backend: two decodes (decode kernel), then a prefill chunk
        # over a cached prefix (extend kernel); 137 tokens: the decode part splits its KV
        extend_lens, prefix_lens = [1, 1, 20], [0, 136, 30]
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        pool, table, inputs, q, k, v = _make_batch(seq_lens, extend_lens, 6, 2, 32, dtype)
        ref = _reference(pool, table, inputs, q, k, v, 0.2)
        backend = TritonAttentionBackend(pool, table, INTERPRETER_KERNELS)
        backend.prepare(inputs)
        assert backend._plan.decode.num_kv_splits > 1  # the combine inside the kernel ran
        _check(backend.forward(q, k, v, 0, 0.2).view(q.shape), ref, tol)
        assert not backend._counters.any()
    print("ok")


if __name__ == "__main__":
    _run_checks()
