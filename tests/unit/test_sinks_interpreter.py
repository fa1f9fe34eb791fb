"""Attention sinks (gpt-oss) in the Triton attention kernels, under Triton's CPU interpreter,
against the torch backend's softmax over [scores, sink]: the decode kernel with 1-4 KV splits
(the sink enters through split 0 alone) and a sliding window, the extend kernel over cached
prefixes with and without GQA, and the backend's mixed step and CUDA-graph decode plan (whose
kernel rotates q and k itself).

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

SCALE = 0.2


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_sink_kernels_under_interpreter():
    from triton_interpreter import run_under_interpreter

    run_under_interpreter(__file__)


def _sinks(num_heads: int) -> torch.Tensor:
    # large enough to take most of some heads' weight, and one head far below every score
    sinks = torch.linspace(-2.0, 3.0, num_heads)
    sinks[0] = -40.0
    return sinks


def _reference(pool, table, inputs, q, k, v, window, sinks):
    """The torch backend's output with the sinks (the new tokens stored in `pool`)."""
    from test_window_interpreter import _copy

    from batchrun.attention.torch_backend import TorchAttentionBackend

    backend = TorchAttentionBackend(_copy(pool), table)
    backend.prepare(inputs)
    out = backend.forward(q.float(), k.float(), v.float(), 0, SCALE, window=window, sinks=sinks)
    pool.store(0, inputs.out_cache_loc, k, v)
    return out.view(q.shape)


def _check_decode(dtype, tol) -> None:
    from batchrun.kernels.decode_attention import decode_counters
    from test_kernels_interpreter import _check, _decode, _make_batch

    seq_lens = [1, 37, 70]
    counters = decode_counters(3, 2, "cpu")
    for window in (0, 8):
        pool, table, inputs, q, k, v = _make_batch(seq_lens, [1] * 3, 6, 2, 32, dtype)
        sinks = _sinks(6)
        ref = _reference(pool, table, inputs, q, k, v, window, sinks)
        no_sink = _reference(_copy_pool(pool), table, inputs, q, k, v, window, None)
        assert (ref - no_sink).abs().max() > 0.05  # the sinks matter here
        for splits in (1, 2, 3, 4):
            out = _decode(pool, table, inputs, q, splits, counters, window=window, sinks=sinks)
            _check(out, ref, tol)
            assert not counters.any(), counters


def _copy_pool(pool):
    from test_window_interpreter import _copy

    return _copy(pool)


def _check_extend(dtype, tol) -> None:
    from batchrun.kernels.extend_attention import extend_attention_fwd
    from test_kernels_interpreter import _check, _make_batch

    extend_lens, prefix_lens = [20, 40, 33], [0, 30, 64]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    for heads, kv_heads in ((6, 2), (4, 4)):
        for window in (0, 5, 23):
            pool, table, inputs, q, k, v = _make_batch(
                seq_lens, extend_lens, heads, kv_heads, 32, dtype
            )
            sinks = _sinks(heads)
            ref = _reference(pool, table, inputs, q, k, v, window, sinks)
            ext = inputs.extend_lens
            out = torch.full_like(q, float("nan"))
            extend_attention_fwd(
                q, *pool.buffers(0), out, table, inputs.req_pool_indices, inputs.seq_lens,
                ext, torch.cumsum(ext, 0) - ext, max(extend_lens), SCALE, block_n=16,
                window=window, sinks=sinks,
            )  # fmt: skip
            _check(out, ref, tol)


def _check_backend(dtype, tol) -> None:
    """TritonAttentionBackend with sinks: a mixed step, and the CUDA-graph decode plan whose
    kernel rotates q and k itself against the eager plan."""
    from test_kernels_interpreter import _check, _make_batch

    from batchrun.attention.triton_backend import TritonAttentionBackend
    from batchrun.layers.rotary import RotaryEmbedding

    extend_lens, prefix_lens = [1, 1, 20], [0, 136, 30]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool, table, inputs, q, k, v = _make_batch(seq_lens, extend_lens, 6, 2, 32, dtype)
    sinks = _sinks(6)
    ref = _reference(pool, table, inputs, q, k, v, 24, sinks)
    backend = TritonAttentionBackend(pool, table, INTERPRETER_KERNELS)
    backend.prepare(inputs)
    out = backend.forward(q, k, v, 0, SCALE, window=24, sinks=sinks)
    _check(out.view(q.shape), ref, tol)

    results = []
    for graph in (True, False):
        batch = _make_batch([1, 37, 70], [1, 1, 1], 6, 2, 32, dtype, INTERPRETER_KERNELS)
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
        q_rot, k_rot = rotary(positions, q.clone(), k.clone())
        ref = _reference(_copy_pool(pool), table, inputs, q_rot, k_rot, v, 0, sinks)
        out = backend.forward_rotary(q.clone(), k.clone(), v, 0, SCALE, positions, rotary,
                                     sinks=sinks)  # fmt: skip
        _check(out.view(q.shape), ref, tol)
        results.append(out)
    assert torch.equal(results[0], results[1])


def _run_checks() -> None:
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 4e-3)):
        _check_decode(dtype, tol)
        _check_extend(dtype, tol)
        _check_backend(dtype, tol)
    print("ok")


if __name__ == "__main__":
    _run_checks()
