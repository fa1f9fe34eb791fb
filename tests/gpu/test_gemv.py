"""kernels/gemv.py against F.linear on the GPU: the decode shapes of the benchmark models, M from
1 to 16, bf16 / fp16 / fp32, split-K on and off, and every output element written."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SHAPES = [(3072, 2048), (2048, 8192), (16384, 2048), (6144, 4096), (100, 300), (4095, 1000)]
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gemv_matches_linear(n, k, m, dtype):
    from batchrun.kernels.gemv import GemvConfig, gemv

    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).to(dtype)
    ref = F.linear(x.float(), w.float())
    for cfg in (None, GemvConfig(32, 256, 1), GemvConfig(16, 128, 4), GemvConfig(64, 512, 8)):
        out = gemv(x, w, cfg)
        assert out.shape == (m, n) and out.dtype == dtype
        assert torch.isfinite(out).all()
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel <= TOL[dtype], (cfg, rel)


def test_gemv_under_graph_capture_and_deterministic():
    """Split-K allocates its fp32 planes inside the graph's pool; replays give the eager result
    bit for bit (the planes are summed in a fixed order: no atomics)."""
    from batchrun.kernels.gemv import GemvConfig, gemv

    x = torch.randn(2, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) * 0.05
    cfg = GemvConfig(32, 256, 4)
    eager = gemv(x, w, cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, w, cfg)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_linear_takes_the_kernel_only_when_asked(monkeypatch):
    """models.layers.linear: F.linear by default; with BATCHRUN_GEMV=triton, kernels/gemv.py
    for inputs of at most 16 rows (decode), F.linear above."""
    from batchrun.kernels.gemv import gemv

    from batchrun.models.layers import GEMV_ENV, linear

    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    small = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    large = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    monkeypatch.delenv(GEMV_ENV, raising=False)
    assert torch.equal(linear(small, w), F.linear(small, w))
    monkeypatch.setenv(GEMV_ENV, "triton")
    assert torch.equal(linear(small, w), gemv(small, w))
    assert torch.equal(linear(large, w), F.linear(large, w))
