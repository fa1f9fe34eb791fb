"""The Triton attention kernels under Triton's CPU interpreter, against the torch backend.

Skipped where triton is not installed (CI does not install it). The kernels run in a subprocess
because TRITON_INTERPRET must be set before triton is first imported. The interpreter's tl.dot
is wrong for bf16 inputs (a triton limitation), so only fp32 and fp16 run here; tests/gpu covers
bf16 on the GPU.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_kernels_under_interpreter():
    sys.path.insert(0, str(REPO / "tests"))
    from triton_interpreter import run_under_interpreter

    run_under_interpreter(__file__)


def _make_batch(seq_lens, extend_lens, num_heads, num_kv_heads, head_dim, dtype):
    from batchrun.attention.base import AttentionInputs
    from batchrun.engine.kv_pool import KVPool

    gen = torch.Generator().manual_seed(0)
    num_slots = sum(seq_lens) + 5
    pool = KVPool(1, num_slots, num_kv_heads, head_dim, dtype, "cpu")
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


def _decode(pool, table, inputs, q, splits, counters, workspace=None, fold=True, **kwargs):
    from batchrun.kernels.decode_attention import decode_attention_fwd, decode_workspace_numel

    if workspace is None:
        workspace = torch.full((decode_workspace_numel(*q.shape[:2], 32, splits),), float("nan"))
    out = torch.full_like(q, float("nan"))
    decode_attention_fwd(
        q, *pool.buffers(0), out, table, inputs.req_pool_indices, inputs.seq_lens, 0.2, splits,
        workspace, counters, fold_stage2=fold, block_n=16, **kwargs,
    )  # fmt: skip
    return out


def _check_decode(dtype, tol) -> None:
    from batchrun.kernels.decode_attention import decode_counters, decode_workspace_numel

    # block_n 16 and 4 splits: request 1 fills split 0 only, 37 splits 0-2, 70 splits 0-2
    seq_lens = [1, 37, 70]
    pool, table, inputs, q, k, v = _make_batch(seq_lens, [1, 1, 1], 6, 2, 32, dtype)
    ref = _reference(pool, table, inputs, q, k, v, 0.2)
    counters = decode_counters(3, 2, "cpu")
    for splits in (1, 2, 3, 4):
        apart = _decode(pool, table, inputs, q, splits, counters, fold=False)
        _check(apart, ref, tol)
        for _ in range(2):  # twice on the same counters: the last split program reset them
            folded = _decode(pool, table, inputs, q, splits, counters)
            assert torch.equal(folded, apart), splits
            assert not counters.any(), counters
        # the grid's order and the loads' eviction policy change no program's arithmetic
        other = _decode(pool, table, inputs, q, splits, counters, heads_first=False,
                        evict="evict_first")  # fmt: skip
        assert torch.equal(other, apart), splits
        assert not counters.any(), counters
    # the interpreter runs split S - 1 last; a counter that starts at 1 makes split S - 2 the
    # combiner instead (split S - 1's partial is already in the workspace from the same call
    # before): the same bits, because the combine reads every split from memory in split order
    workspace = torch.empty(decode_workspace_numel(3, 6, 32, 4))
    _decode(pool, table, inputs, q, 4, counters, workspace)
    counters.fill_(1)
    assert torch.equal(_decode(pool, table, inputs, q, 4, counters, workspace), folded)


def _check_decode_rope(dtype) -> None:
    """The decode kernel that rotates q and the new k itself and stores the new k and v
    (DecodeRope) against kernels/rotary_kv_store.py then the plain decode kernel: the same
    output and the same pool, bit for bit, for 1-4 splits, folded or not; and the backend's
    forward_rotary on a graph plan with BATCHRUN_DECODE_ROPE on and off, and on an eager one."""
    import os

    from batchrun.kernels.decode_attention import (
        DecodeRope,
        decode_attention_fwd,
        decode_counters,
        decode_workspace_numel,
    )
    from batchrun.kernels.rotary_kv_store import rotary_store_kv

    import batchrun.models.layers as layers
    from batchrun.attention.triton_backend import DECODE_ROPE_ENV, TritonAttentionBackend
    from batchrun.models.layers import RotaryEmbedding

    rotary = RotaryEmbedding(32, 256, 10000.0, {}, "cpu")
    cos, sin = rotary.cos_cache, rotary.sin_cache
    seq_lens = [1, 37, 70]
    pool, table, inputs, q, k, v = _make_batch(seq_lens, [1, 1, 1], 6, 2, 32, dtype)
    positions = inputs.seq_lens - 1
    loc = inputs.out_cache_loc
    counters = decode_counters(3, 2, "cpu")
    for splits in (1, 2, 4):
        for fold in (True, False):
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
                    0.2, splits, workspace, counters, fold_stage2=fold, rope=rope, block_n=16,
                )  # fmt: skip
            assert torch.equal(outs[1], outs[0]), (splits, fold)
            assert torch.equal(bufs[1][0], bufs[0][0]) and torch.equal(bufs[1][1], bufs[0][1])
            assert not counters.any()

    # through the backend: a CUDA-graph decode plan (static buffers) takes the kernel's own
    # rotary and store, an eager one the two kernels; both give these bits
    results = []
    use_fused = layers.use_fused_kernels
    layers.use_fused_kernels = lambda x: True
    try:
        for switch, graph in (("0", True), ("1", True), ("1", False)):
            os.environ[DECODE_ROPE_ENV] = switch
            run_pool = _make_batch(seq_lens, [1, 1, 1], 6, 2, 32, dtype)[0]
            backend = TritonAttentionBackend(run_pool, table)
            if graph:
                backend.init_graph_buffers(4)
                backend.prepare_graph(3)
                backend.load_graph_inputs(inputs, 3)
            else:
                backend.prepare(inputs)
            args = (0, loc, q, k, v, positions, rotary)
            assert backend._rotates_in_decode(*args) == (switch == "1" and graph)
            out = backend.forward_rotary(q.clone(), k, v, 0, 0.2, positions, rotary)
            results.append((out, *run_pool.buffers(0)))
    finally:
        layers.use_fused_kernels = use_fused
        os.environ.pop(DECODE_ROPE_ENV, None)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def _run_checks() -> None:
    from batchrun.kernels.extend_attention import extend_attention_fwd

    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 4e-3)):
        _check_decode(dtype, tol)
        _check_decode_rope(dtype)

        extend_lens, prefix_lens = [1, 20, 40], [0, 17, 30]
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        pool, table, inputs, q, k, v = _make_batch(seq_lens, extend_lens, 6, 2, 32, dtype)
        ref = _reference(pool, table, inputs, q, k, v, 0.2)
        ext = inputs.extend_lens
        # GQA 6 / 2: packed programs hold 3 heads padded to 4 (16 or 64 query rows), unpacked 1
        for pack, block_m in ((True, 4), (True, 16), (False, 16)):
            out = torch.full_like(q, float("nan"))
            extend_attention_fwd(
                q, *pool.buffers(0), out, table, inputs.req_pool_indices, inputs.seq_lens, ext,
                torch.cumsum(ext, 0) - ext, max(extend_lens), 0.2, block_m=block_m, block_n=16,
                pack_heads=pack,
            )  # fmt: skip
            _check(out, ref, tol)

        # a mixed step through the backend: two decodes (decode kernel), then a prefill chunk
        # over a cached prefix (extend kernel); 137 tokens: the decode part splits its KV
        from batchrun.attention.triton_backend import TritonAttentionBackend

        extend_lens, prefix_lens = [1, 1, 20], [0, 136, 30]
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        pool, table, inputs, q, k, v = _make_batch(seq_lens, extend_lens, 6, 2, 32, dtype)
        ref = _reference(pool, table, inputs, q, k, v, 0.2)
        backend = TritonAttentionBackend(pool, table)
        backend.prepare(inputs)
        assert backend._plan.decode.num_kv_splits > 1  # the folded combine ran
        _check(backend.forward(q, k, v, 0, 0.2).view(q.shape), ref, tol)
        assert not backend._counters.any()
    print("ok")


if __name__ == "__main__":
    _run_checks()
