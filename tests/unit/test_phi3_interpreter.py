"""Partial rotary (Phi-3 / Phi-4) on the Triton kernels under Triton's CPU interpreter: the
in-place rotary kernel rotates the first rotary_dim dims of each head as the torch path does and
leaves the rest as they are; a tiny Phi-3 on an engine with the Triton kernels and the Triton
attention (which rotates apart from its KV store for a partial-rotary model: KVPool.fuses_rotary)
gives the torch engine's logits and greedy tokens.

Skipped where triton is not installed. The kernels run in a subprocess because TRITON_INTERPRET
must be set before triton is first imported (tests/triton_interpreter.py).
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
from triton_interpreter import INTERPRETER_KERNELS  # noqa: E402


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_partial_rotary_under_interpreter():
    from triton_interpreter import run_under_interpreter

    run_under_interpreter(__file__)


def _check_partial_rotary(dtype) -> None:
    from batchrun.kernels.fused_rotary import apply_rotary_

    from batchrun.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(1)
    for num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim in (
        (7, 6, 2, 64, 32),
        (3, 4, 1, 128, 96),  # Phi-4-mini's
        (5, 3, 3, 80, 40),
    ):
        scaling = {
            "rope_type": "longrope",
            "short_factor": [1.0 + i / 8 for i in range(rotary_dim // 2)],
            "long_factor": [2.0 + i for i in range(rotary_dim // 2)],
            "original_max_position_embeddings": 64,
            "attention_factor": 1.19,
        }
        rotary = RotaryEmbedding(rotary_dim, 300, 10000.0, scaling, "cpu")
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, num_heads, head_dim)  # strided views, as in llama.py
        k = k.view(num_tokens, num_kv_heads, head_dim)
        before = qkv.clone()
        positions = torch.randint(0, 300, (num_tokens,), generator=gen)
        ref_q, ref_k = rotary(positions, q, k)  # the torch path: new tensors
        apply_rotary_(q, k, positions, rotary.cos_cache, rotary.sin_cache)
        assert torch.equal(v, before[:, q_size + kv_size :]), "v was written"
        for name, out, ref in (("q", q, ref_q), ("k", k, ref_k)):
            assert torch.equal(out, ref), ("rotary", name, dtype, head_dim, rotary_dim)
        passed = before[:, :q_size].view(num_tokens, num_heads, head_dim)[..., rotary_dim:]
        assert torch.equal(q[..., rotary_dim:], passed), "the dims past rotary_dim changed"


def _check_engine(tmp_dir: Path) -> None:
    from tiny_models import make_tiny_model, random_prompts

    from batchrun.config import EngineConfig, KernelPlan
    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    path = Path(tempfile.mkdtemp(dir=tmp_dir))
    make_tiny_model("phi3", path)
    base = dict(model=str(path), device="cpu", dtype="float32", kv_budget=1024, context_len=128)
    ref_engine = Engine(EngineConfig(**base), kernels=KernelPlan.reference())
    engine = Engine(EngineConfig(**base), kernels=INTERPRETER_KERNELS)
    runner = engine.runner
    assert engine.kernels.attention == "triton" and engine.kernels.triton_ops
    rotary = runner.model.rotary
    assert rotary.cos_cache.shape[1] == 8 < runner.model_cfg.head_dim
    q = torch.zeros(1, 4, 16)
    k = v = torch.zeros(1, 2, 16)
    loc, positions = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    assert not runner.kv_pool.fuses_rotary(0, loc, q, k, v, positions, rotary)
    for prompt in random_prompts(2, seed=3, min_len=5, max_len=20):
        ref, fused = ref_engine.score(prompt), engine.score(prompt)
        rel = ((fused - ref).norm() / ref.norm()).item()
        assert rel <= 1e-5, rel
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(random_prompts(3, seed=5))]
    ref_out = {r.rid: r.output_ids for r in ref_engine.generate(reqs)}
    assert {r.rid: r.output_ids for r in engine.generate(reqs)} == ref_out
    engine.check_integrity()


def _run_checks() -> None:
    for dtype in (torch.float32, torch.float16):
        _check_partial_rotary(dtype)
    with tempfile.TemporaryDirectory() as tmp_dir:
        _check_engine(Path(tmp_dir))
    print("ok")


if __name__ == "__main__":
    _run_checks()
