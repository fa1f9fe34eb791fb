"""The Triton attention kernels with a sliding window, under Triton's CPU interpreter, against the
torch backend with the window's mask; and the KV they must not read: each request's positions
before every query's window hold NaN in the pool (a NaN read would reach the output, even at
weight 0), so a kernel that loads a block wholly outside the window fails here.

Runs in a subprocess (tests/triton_interpreter.py), in fp32 and fp16 (the interpreter's tl.dot
is wrong for bf16 inputs).
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
sys.path.insert(0, str(REPO / "tests" / "unit"))
from triton_interpreter import INTERPRETER_KERNELS  # noqa: E402

BLOCK_N = 16


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_window_kernels_under_interpreter():
    from triton_interpreter import run_under_interpreter

    run_under_interpreter(__file__)


def _reference(pool, table, inputs, q, k, v, window):
    """The torch backend's output with the window (and the new tokens stored in `pool`)."""
    from batchrun.attention.torch_backend import TorchAttentionBackend
    from batchrun.engine.kv_pool import KVPool

    num_kv_heads, head_dim = pool.k_buffers[0].shape[1:]
    ref_pool = KVPool(1, pool.num_slots, num_kv_heads, head_dim, torch.float32, "cpu")
    ref_pool.k_buffers[0].copy_(pool.k_buffers[0])
    ref_pool.v_buffers[0].copy_(pool.v_buffers[0])
    backend = TorchAttentionBackend(ref_pool, table)
    backend.prepare(inputs)
    out = backend.forward(q.float(), k.float(), v.float(), 0, 0.2, window=window)
    pool.store(0, inputs.out_cache_loc, k, v)
    return out.view(q.shape)


def _poison(pool, table, inputs, unread) -> None:
    """NaN into the KV of request b's positions [0, unread[b])."""
    for b, n in enumerate(unread):
        if n > 0:
            slots = table[inputs.req_pool_indices[b], :n].long()
            pool.k_buffers[0][slots] = float("nan")
            pool.v_buffers[0][slots] = float("nan")


def _check_decode(dtype, tol) -> None:
    from batchrun.kernels.decode_attention import decode_counters
    from test_kernels_interpreter import _check, _decode, _make_batch

    seq_lens = [9, 37, 70]
    counters = decode_counters(3, 2, "cpu")
    for window in (1, 8, 20, 37, 100):
        pool, table, inputs, q, k, v = _make_batch(seq_lens, [1] * 3, 6, 2, 32, dtype)
        ref = _reference(pool, table, inputs, q, k, v, window)
        # the decode kernel reads from the window's first position on, never before it
        _poison(pool, table, inputs, [s - window for s in seq_lens])
        for splits in (1, 2, 4):
            out = _decode(pool, table, inputs, q, splits, counters, window=window)
            _check(out, ref, tol)
            assert not counters.any(), counters


def _check_extend(dtype, tol) -> None:
    """Prefills and chunks over cached prefixes, windows shorter and longer than the blocks,
    the query block's tokens (block_m) and the KV block; no GQA and GQA 6 / 2."""
    from batchrun.kernels.extend_attention import extend_attention_fwd
    from test_kernels_interpreter import _check, _make_batch

    extend_lens, prefix_lens = [20, 40, 33], [0, 30, 64]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    for heads, kv_heads in ((6, 2), (4, 4)):
        for window in (1, 5, 16, 23, 50, 200):
            pool, table, inputs, q, k, v = _make_batch(
                seq_lens, extend_lens, heads, kv_heads, 32, dtype
            )
            ref = _reference(pool, table, inputs, q, k, v, window)
            # no program of request b loads a block before its first query's window
            first = [max(p - window + 1, 0) // BLOCK_N * BLOCK_N for p in prefix_lens]
            _poison(pool, table, inputs, first)
            ext = inputs.extend_lens
            for block_m in (4, 16) if heads == 6 else (16,):
                out = torch.full_like(q, float("nan"))
                extend_attention_fwd(
                    q, *pool.buffers(0), out, table, inputs.req_pool_indices, inputs.seq_lens,
                    ext, torch.cumsum(ext, 0) - ext, max(extend_lens), 0.2, block_m=block_m,
                    block_n=BLOCK_N, window=window,
                )  # fmt: skip
                _check(out, ref, tol)


def _check_backend(dtype, tol) -> None:
    """TritonAttentionBackend with a window: a mixed step (decode kernel on the decodes, extend
    kernel on the chunk), and a CUDA-graph decode plan whose kernel rotates q and k itself
    against the eager one and the reference."""
    from test_kernels_interpreter import _check, _make_batch

    from batchrun.attention.triton_backend import TritonAttentionBackend
    from batchrun.layers.rotary import RotaryEmbedding

    window = 24
    extend_lens, prefix_lens = [1, 1, 20], [0, 136, 30]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool, table, inputs, q, k, v = _make_batch(seq_lens, extend_lens, 6, 2, 32, dtype)
    ref = _reference(pool, table, inputs, q, k, v, window)
    backend = TritonAttentionBackend(pool, table, INTERPRETER_KERNELS)
    backend.prepare(inputs)
    _check(backend.forward(q, k, v, 0, 0.2, window=window).view(q.shape), ref, tol)

    seq_lens = [1, 37, 70]
    results = []
    for graph in (True, False):
        batch = _make_batch(seq_lens, [1, 1, 1], 6, 2, 32, dtype, INTERPRETER_KERNELS)
        pool, table, inputs, q, k, v = batch
        rotary = RotaryEmbedding(32, 256, 10000.0, {}, "cpu", INTERPRETER_KERNELS)
        positions = inputs.seq_lens - 1
        backend = TritonAttentionBackend(pool, table, INTERPRETER_KERNELS)
        if graph:
            backend.init_graph_buffers(4)
            backend.prepare_graph(3)
            backend.load_graph_inputs(inputs, 3)
        else:
            backend.prepare(inputs)
        args = (0, inputs.out_cache_loc, q, k, v, positions, rotary)
        assert backend._rotates_in_decode(*args) == graph
        q_rot, k_rot = rotary(positions, q.clone(), k.clone())
        ref = _reference(_copy(pool), table, inputs, q_rot, k_rot, v, window)
        out = backend.forward_rotary(q.clone(), k.clone(), v, 0, 0.2, positions, rotary,
                                     window=window)  # fmt: skip
        _check(out.view(q.shape), ref, tol)
        results.append(out)
    assert torch.equal(results[0], results[1])


def _copy(pool):
    """A stand-in for `pool` holding copies of its buffers (the reference stores into it)."""
    from batchrun.engine.kv_pool import KVPool

    num_kv_heads, head_dim = pool.k_buffers[0].shape[1:]
    other = KVPool(1, pool.num_slots, num_kv_heads, head_dim, pool.k_buffers[0].dtype, "cpu")
    other.k_buffers[0].copy_(pool.k_buffers[0])
    other.v_buffers[0].copy_(pool.v_buffers[0])
    return other


def _run_checks() -> None:
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 4e-3)):
        _check_decode(dtype, tol)
        _check_extend(dtype, tol)
        _check_backend(dtype, tol)
    print("ok")


if __name__ == "__main__":
    _run_checks()
