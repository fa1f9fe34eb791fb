"""Gemma 4 on the Triton attention kernels, under Triton's CPU interpreter (a subprocess:
tests/triton_interpreter.py), fp32:

- the decode and extend kernels at head dims 256 and 512 (Gemma 4's sliding and full layers),
  with and without a window, against the torch backend;
- kernels/host_gather.py's rows of a table by token id (the per-layer table in host memory);
- the tiny Gemma 4 models (dense: per-layer head dims and KV heads, k_eq_v; e-model: KV-shared
  layers that attend over another layer's buffers) on the engine with the Triton attention and
  small kernels: greedy tokens past the window equal the torch backend's.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # CI's slow tier (BATCHRUN_SLOW_TESTS=1)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "unit"))
from triton_interpreter import INTERPRETER_KERNELS  # noqa: E402

H100_SHARED_MEMORY = 232448  # the bytes a program may ask for on an H100


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_gemma4_kernels_under_interpreter():
    from triton_interpreter import run_under_interpreter

    run_under_interpreter(__file__)


def _reference(pool, table, inputs, q, k, v, window, scaling):
    from batchrun.attention.torch_backend import TorchAttentionBackend
    from batchrun.engine.kv_pool import KVPool

    num_kv_heads, head_dim = pool.k_buffers[0].shape[1:]
    ref_pool = KVPool(1, pool.num_slots, num_kv_heads, head_dim, torch.float32, "cpu")
    ref_pool.k_buffers[0].copy_(pool.k_buffers[0])
    ref_pool.v_buffers[0].copy_(pool.v_buffers[0])
    backend = TorchAttentionBackend(ref_pool, table)
    backend.prepare(inputs)
    out = backend.forward(q.float(), k.float(), v.float(), 0, scaling, window=window)
    pool.store(0, inputs.out_cache_loc, k, v)
    return out.view(q.shape)


def _check_kernels() -> None:
    from batchrun.kernels.decode_attention import (
        decode_attention_fwd,
        decode_counters,
        decode_workspace_numel,
    )
    from batchrun.kernels.extend_attention import extend_attention_fwd
    from test_kernels_interpreter import _check, _make_batch

    for head_dim, heads in ((256, (4, 2)), (512, (4, 1))):
        for window in (0, 8):
            seq_lens = [3, 21, 40]
            pool, table, inputs, q, k, v = _make_batch(
                seq_lens, [1] * 3, *heads, head_dim, torch.float32
            )
            ref = _reference(pool, table, inputs, q, k, v, window, head_dim**-0.5)
            for splits, shared_memory in ((1, None), (3, None), (3, H100_SHARED_MEMORY)):
                out = torch.full_like(q, float("nan"))
                workspace = torch.empty(decode_workspace_numel(3, heads[0], head_dim, splits))
                decode_attention_fwd(
                    q, *pool.buffers(0), out, table, inputs.req_pool_indices, inputs.seq_lens,
                    head_dim**-0.5, splits, workspace, decode_counters(3, heads[1], "cpu"),
                    window=window, shared_memory=shared_memory,
                )  # fmt: skip
                _check(out, ref, 1e-5)
            extend_lens, prefix_lens = [9, 20], [0, 17]
            seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
            pool, table, inputs, q, k, v = _make_batch(
                seq_lens, extend_lens, *heads, head_dim, torch.float32
            )
            ref = _reference(pool, table, inputs, q, k, v, window, head_dim**-0.5)
            ext = inputs.extend_lens
            # the default tiles, and those that fit an H100's shared memory (fp32 at head dim
            # 512: BLOCK_N 16, one stage; kernels/tile_fit.py)
            for shared_memory in (None, H100_SHARED_MEMORY):
                out = torch.full_like(q, float("nan"))
                extend_attention_fwd(
                    q, *pool.buffers(0), out, table, inputs.req_pool_indices, inputs.seq_lens,
                    ext, torch.cumsum(ext, 0) - ext, max(extend_lens), head_dim**-0.5,
                    window=window, shared_memory=shared_memory,
                )  # fmt: skip
                _check(out, ref, 1e-5)


def _check_engine(tmp_dir: Path) -> None:
    from gemma4_models import WINDOW, make_gemma4
    from tiny_models import random_prompts

    from batchrun.config import EngineConfig, KernelPlan
    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(3, seed=4, min_len=WINDOW + 2, max_len=WINDOW + 20)
    for kind in ("dense", "e-model"):
        path = Path(tempfile.mkdtemp(dir=tmp_dir))
        make_gemma4(kind, path)
        base = dict(model=str(path), device="cpu", dtype="float32", kv_budget=512)
        outs = []
        for kernels in (KernelPlan.reference(), INTERPRETER_KERNELS):
            engine = Engine(EngineConfig(**base), kernels=kernels)
            reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
            outs.append({r.rid: r.output_ids for r in engine.generate(reqs)})
            engine.check_integrity()
        assert engine.kernels.attention == "triton"
        assert outs[0] == outs[1], kind


def _check_host_gather() -> None:
    """kernels/host_gather.py's gather_rows (the per-layer table's rows by token id, times the
    scale) against torch's indexing, with rows wider than its column block."""
    from batchrun.kernels.host_gather import gather_rows

    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float16):
        for width in (48, 2500):
            table = torch.randn(37, width, generator=gen).to(dtype)
            ids = torch.tensor([0, 36, 5, 5, 17], dtype=torch.int32)
            want = table[ids.long()] * 16.0
            assert torch.equal(gather_rows(table, ids, 16.0), want), (dtype, width)
            assert gather_rows(table, ids[:0]).shape == (0, width)


def _run_checks() -> None:
    _check_host_gather()
    _check_kernels()
    with tempfile.TemporaryDirectory() as tmp:
        _check_engine(Path(tmp))
    print("ok")


if __name__ == "__main__":
    _run_checks()
