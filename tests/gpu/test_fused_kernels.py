"""Fused RMSNorm / rotary / SiLU-and-mul kernels against batchrun's torch code on CUDA, and a tiny
model's logits with the kernels against BATCHRUN_NO_FUSED=1.

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

from batchrun.models.layers import RMSNorm, RotaryEmbedding, _apply_rotary  # noqa: E402

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
    """RMSNorm.forward's torch formula (layers.py), independent of the fused switch."""
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
    # an FMA may contract x1 * c - x2 * s, skipping one rounding (seen on the H200 in bf16): allow
    # two roundings of the products' size, which cancellation can make large next to the result
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
    # fp32: Triton's fast exp in silu differs from torch's by up to ~13 ulps (1e-6 relative),
    # measured on the H200
    bound = 32 if dtype == torch.float32 else MAX_ULPS[dtype]
    if num_tokens:
        assert max_ulps(out, ref) <= bound, max_ulps(out, ref)


def test_rmsnorm_module_dispatch(monkeypatch):
    """The module path (reshape of a 3D strided q view, as Qwen3's q_norm sees) and the switch."""
    norm = RMSNorm(64, 1e-6, torch.bfloat16, DEV)
    qkv = randn(7, 3 * 4 * 64, dtype=torch.bfloat16)
    q = qkv[:, : 4 * 64].view(7, 4, 64)
    fused = norm(q)
    monkeypatch.setenv("BATCHRUN_NO_FUSED", "1")
    assert max_ulps(fused, norm(q)) <= MAX_ULPS[torch.bfloat16]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_model(request.param, path)
    return path


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 3e-2), ("float16", 5e-3)])
def test_model_logits_fused_vs_torch(tiny_dir, dtype, tol, monkeypatch):
    from batchrun.engine.config import EngineConfig
    from batchrun.engine.engine import Engine

    engine = Engine(
        EngineConfig(
            model=str(tiny_dir), device="cuda", dtype=dtype, kv_budget=8192, cuda_graph_max_bs=0
        )
    )
    for prompt in random_prompts(3, seed=1, min_len=8, max_len=60):
        monkeypatch.delenv("BATCHRUN_NO_FUSED", raising=False)
        fused = engine.score(prompt)
        monkeypatch.setenv("BATCHRUN_NO_FUSED", "1")
        ref = engine.score(prompt)
        rel = ((fused - ref).norm() / ref.norm()).item()
        assert rel <= tol, f"relative error {rel:.2e}"
