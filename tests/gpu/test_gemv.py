"""kernels/gemv.py against F.linear, and gemv_residual against gemv + add + norm, on the
GPU: the decode shapes of the benchmark models, M from 1 to 16, bf16 / fp16 (gemv: fp32 too),
split-K on and off, every output element written; and the engine with decode_gemv "triton"
against "cublas", in every decode_norms mode."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

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
    from batchrun.kernels.gemv import GemvConfig, gemv, split_counters

    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).to(dtype)
    ref = F.linear(x.float(), w.float())
    configs = (None, GemvConfig(32, 256, 1), GemvConfig(16, 128, 4), GemvConfig(64, 512, 8),
               GemvConfig(32, 128, 3))  # fmt: skip
    for cfg in configs:
        out = gemv(x, w, cfg)
        assert out.shape == (m, n) and out.dtype == dtype
        assert torch.isfinite(out).all()
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel <= TOL[dtype], (cfg, rel)
        assert not split_counters(x.device).any()  # left at zero for the next call


@pytest.mark.parametrize("inter,k", [(8192, 2048), (14336, 4096), (1000, 300)])
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_swiglu_matches_gemv_then_the_gate(inter, k, m, dtype):
    """The SwiGLU epilogue against the [M, 2I] gemv then silu_and_mul, with and without split-K:
    the same rounding (gate and up to the dtype, then the gate's kernel's formula); the fp32 sums
    may differ in order between configs, so within a few bf16 / fp16 ulps."""
    from batchrun.kernels.activation import silu_and_mul
    from batchrun.kernels.gemv import GemvConfig, gemv, split_counters

    g = torch.Generator(device="cuda").manual_seed(inter + k + m)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(2 * inter, k, device="cuda", generator=g) * 0.05).to(dtype)
    for cfg in (None, GemvConfig(16, 256, 1), GemvConfig(32, 256, 4), GemvConfig(16, 128, 3)):
        want = silu_and_mul(gemv(x, w, cfg))
        got = gemv(x, w, cfg, swiglu=True)
        assert got.shape == (m, inter) and got.dtype == dtype and torch.isfinite(got).all()
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert rel <= TOL[dtype], (cfg, rel)
        assert not split_counters(x.device).any()


@pytest.mark.parametrize("swiglu", [False, True])
def test_gemv_under_graph_capture_and_deterministic(swiglu):
    """Split-K allocates its fp32 planes inside the graph's pool and reduces in the kernel (the
    last K slice of a column tile sums every plane in slice order): replays with new inputs give
    the eager result bit for bit, and the counters stay at zero."""
    from batchrun.kernels.gemv import GemvConfig, gemv, split_counters

    x = torch.randn(2, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16) * 0.05
    static_x = x.clone()
    cfgs = [GemvConfig(32, 256, 4), GemvConfig(16, 128, 3), GemvConfig(64, 512, 1)]
    graph = torch.cuda.CUDAGraph()
    gemv(static_x, w, cfgs[0], swiglu=swiglu)  # eager first: allocates the counters
    with torch.cuda.graph(graph):
        outs = [gemv(static_x, w, cfg, swiglu=swiglu) for cfg in cfgs]
    for seed in range(3):
        static_x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        for cfg, out in zip(cfgs, outs):
            assert torch.equal(out, gemv(static_x, w, cfg, swiglu=swiglu)), cfg
        assert not split_counters(x.device).any()


def test_gemv_split_k_is_deterministic_under_contention():
    """Many K slices per column tile, replayed many times: which slice finishes last varies, the
    bits of the result do not."""
    from batchrun.kernels.gemv import GemvConfig, gemv

    x = torch.randn(1, 8192, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 8192, device="cuda", dtype=torch.bfloat16) * 0.05
    cfg = GemvConfig(16, 128, 8)
    first = gemv(x, w, cfg)
    for _ in range(50):
        assert torch.equal(gemv(x, w, cfg), first)


def test_linear_takes_the_kernel_only_when_asked():
    """layers/linear.py's linear: F.linear without a kernel config and with decode_gemv
    "cublas"; with "triton", kernels/gemv.py for every bf16 / fp16 input of at most
    GEMV_MAX_ROWS rows (decode) without a bias, whatever the weight's shape; F.linear for more
    rows, a bias or fp32."""
    from batchrun.kernels.gemv import gemv

    from batchrun.config import KernelPlan
    from batchrun.layers.linear import GEMV_MAX_ROWS, linear, takes_gemv

    triton, cublas = (KernelPlan(decode_gemv=name, pdl=False) for name in ("triton", "cublas"))
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, **bf16) * 0.05
    narrow = torch.randn(512, 2048, **bf16) * 0.05
    bias = torch.randn(512, **bf16)
    small = torch.randn(4, 4096, **bf16)
    decode = torch.randn(GEMV_MAX_ROWS, 2048, **bf16)
    large = torch.randn(GEMV_MAX_ROWS + 1, 2048, **bf16)
    assert torch.equal(linear(small, w), F.linear(small, w))
    assert torch.equal(linear(small, w, kernels=cublas), F.linear(small, w))
    assert not takes_gemv(small, None, cublas)
    assert takes_gemv(small, None, triton) and takes_gemv(decode, None, triton)
    assert torch.equal(linear(small, w, kernels=triton), gemv(small, w))
    assert torch.equal(linear(decode, narrow, kernels=triton), gemv(decode, narrow))
    assert not takes_gemv(large, None, triton)
    assert torch.equal(linear(large, narrow, kernels=triton), F.linear(large, narrow))
    assert not takes_gemv(decode, bias, triton)
    assert torch.equal(linear(decode, narrow, bias, triton), F.linear(decode, narrow, bias))
    fp32 = decode.float()
    assert not takes_gemv(fp32, None, triton)
    assert torch.equal(linear(fp32, narrow.float(), kernels=triton), F.linear(fp32, narrow.float()))


# (hidden, K) of the matmuls that write the residual stream: llama-1b's o_proj and down_proj,
# llama-8b's, a ragged one
RESIDUAL_SHAPES = [(2048, 2048), (2048, 8192), (4096, 4096), (4096, 14336), (300, 1000)]


@pytest.mark.parametrize("hidden,k", RESIDUAL_SHAPES)
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_residual_matches_gemv_add_and_norm(hidden, k, m, dtype):
    """gemv_residual (split-K as pick_config picks, and forced) writes gemv(x, w) + residual bit
    for bit; for one row, the norm that its last column tile computes is within an ulp of
    rms_norm's (the same formula; its sum of squares may reduce in another order)."""
    from batchrun.kernels.fused_norm import rms_norm
    from batchrun.kernels.gemv import GemvConfig, gemv, gemv_residual, split_counters

    g = torch.Generator(device="cuda").manual_seed(hidden + k + m)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(hidden, k, device="cuda", generator=g) * 0.05).to(dtype)
    residual = torch.randn(m, hidden, device="cuda", generator=g).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(dtype)
    residual0 = residual.clone()
    eps = torch.finfo(dtype).eps
    for cfg in (None, GemvConfig(32, 128, 4), GemvConfig(64, 256, 1)):
        want = gemv(x, w, cfg) + residual
        h, normed = gemv_residual(x, w, residual, config=cfg)
        assert torch.equal(h, want) and normed is None
        if m == 1:
            h, normed = gemv_residual(x, w, residual, norm=(norm_w, 1e-5), config=cfg)
            assert torch.equal(h, want)
            ref = rms_norm(want, norm_w, 1e-5)
            torch.testing.assert_close(normed.float(), ref.float(), rtol=eps, atol=1e-6)
        assert torch.equal(residual, residual0)  # not written
        assert not split_counters(x.device).any()  # the split and row counters back at zero


def test_gemv_residual_norm_under_graph_capture():
    """A one-row layer's gemv chain (o_proj with the residual and the norm, gate_up with the
    SwiGLU, down_proj with the residual and the norm, qkv) captured and replayed with new
    inputs: the eager bits every replay, the counters at zero."""
    from batchrun.kernels.gemv import gemv, gemv_residual, split_counters

    g = torch.Generator(device="cuda").manual_seed(3)
    bf16 = torch.bfloat16

    def weight(n, k):
        return (torch.randn(n, k, device="cuda", generator=g) * 0.05).to(bf16)

    w_o, w_gate_up = weight(2048, 2048), weight(16384, 2048)
    w_down, w_qkv = weight(2048, 8192), weight(3072, 2048)
    norm = (torch.ones(2048, device="cuda", dtype=bf16), 1e-5)

    def chain(attn_out, residual):
        h, normed = gemv_residual(attn_out, w_o, residual, norm=norm)
        act = gemv(normed, w_gate_up, swiglu=True)
        h, normed = gemv_residual(act, w_down, h, norm=norm)
        return gemv(normed, w_qkv), h

    attn_out = torch.randn(1, 2048, device="cuda", dtype=bf16)
    residual = torch.randn(1, 2048, device="cuda", dtype=bf16)
    chain(attn_out, residual)  # eager first: compiles, allocates the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(attn_out, residual)
    for seed in range(5):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        attn_out.copy_(torch.randn(attn_out.shape, device="cuda", generator=gen))
        residual.copy_(torch.randn(residual.shape, device="cuda", generator=gen))
        graph.replay()
        want = chain(attn_out, residual)
        torch.cuda.synchronize()
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
        assert not split_counters(attn_out.device).any()


@pytest.mark.parametrize("n,k", [(6144, 4096), (3072, 2048), (100, 300)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_rms_matches_norm_then_gemv(n, k, dtype):
    """gemv_rms (the input RMSNorm inside the qkv matmul, on the folded weight) against the norm
    kernel then gemv, in fp32 terms (bf16 / fp16 tolerance), every element written; and captured
    in a CUDA graph after a gemv_residual (as a decode layer runs it), replayed with new inputs:
    the eager bits."""
    from batchrun.kernels.fused_norm import rms_norm
    from batchrun.kernels.gemv import gemv_residual, gemv_rms, rms_fold_weight

    g = torch.Generator(device="cuda").manual_seed(n + k)
    h = (torch.randn(1, k, device="cuda", generator=g) * 4).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).to(dtype)
    norm_w = (torch.rand(k, device="cuda", generator=g) + 0.5).to(dtype)
    folded = rms_fold_weight(w, norm_w)
    ref = F.linear(rms_norm(h, norm_w, 1e-5).float(), w.float())
    out = gemv_rms(h, folded, 1e-5)
    assert out.shape == (1, n) and torch.isfinite(out).all()
    assert ((out.float() - ref).norm() / ref.norm()).item() <= TOL[dtype]

    w_down = (torch.randn(k, 512, device="cuda", generator=g) * 0.05).to(dtype)
    act, residual = torch.randn(1, 512, device="cuda", dtype=dtype), h.clone()

    def chain():
        return gemv_rms(gemv_residual(act, w_down, residual).h, folded, 1e-5)

    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = chain()
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        act.copy_(torch.randn(act.shape, device="cuda", generator=gen))
        residual.copy_(torch.randn(residual.shape, device="cuda", generator=gen) * 4)
        graph.replay()
        want = chain()
        torch.cuda.synchronize()
        assert torch.equal(replayed, want)


@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
def test_gemv_rms_split_and_swiglu(split, swiglu):
    """gemv_rms with its K split (each slice scales its partial sums by rstd) and with the SwiGLU
    gate (the post-attention norm inside gate_up, "fold-all") against the norm kernel, then
    F.linear and the gate in bf16 terms; the same bits call to call."""
    from batchrun.kernels.activation import silu_and_mul
    from batchrun.kernels.fused_norm import rms_norm
    from batchrun.kernels.gemv import gemv_rms, pick_config, rms_fold_weight, split_counters

    n, k = (2 * 1792, 4096) if swiglu else (6144, 4096)
    g = torch.Generator(device="cuda").manual_seed(split)
    h = (torch.randn(1, k, device="cuda", generator=g) * 4).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    norm_w = (torch.rand(k, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    ref = F.linear(rms_norm(h, norm_w, 1e-5).float(), w.float())
    if swiglu:
        ref = silu_and_mul(ref.to(torch.bfloat16)).float()
    cfg = pick_config(1, n, k)._replace(split_k=split, block_n=32 if swiglu else 64)
    folded = rms_fold_weight(w, norm_w)
    out = gemv_rms(h, folded, 1e-5, cfg, swiglu=swiglu)
    assert out.shape == (1, n // 2 if swiglu else n) and torch.isfinite(out).all()
    assert ((out.float() - ref).norm() / ref.norm()).item() <= TOL[torch.bfloat16]
    assert not split_counters(h.device).any()
    assert torch.equal(gemv_rms(h, folded, 1e-5, cfg, swiglu=swiglu), out)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("norms", ["all", "off", "fold-all"])
def test_engine_with_decode_gemv(kind, norms, tmp_path):
    """decode_gemv "triton" (every decode matmul of up to 16 rows on kernels/gemv.py), with the
    one-row decode's norms and residual adds in each decode_norms mode (all, off, fold-all), end
    to end against decode_gemv "cublas": prompts of at most 16 tokens and of
    one token score like cuBLAS (bf16 tolerance), and a greedy batch and a lone request (decode
    batches of one row) decode through CUDA graphs captured with the Triton decode kernels,
    mostly to the same tokens (bf16 near-ties on random weights may flip a token; after that
    the rest differs)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_models import make_tiny_model, random_prompts

    from batchrun.config import EngineConfig, KernelPlan
    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    make_tiny_model(kind, tmp_path)

    def run(on: bool):
        kernels = (
            KernelPlan(decode_gemv="triton", decode_norms=norms)
            if on
            else KernelPlan(decode_gemv="cublas")
        )
        # NOTE: a small KV pool: by default an engine takes most of the GPU's free memory, and
        # the tests after this one need some
        config = EngineConfig(model=str(tmp_path), device="cuda", dtype="bfloat16", kv_budget=8192)
        engine = Engine(config, kernels)
        try:
            assert engine.kernels.decode_gemv == ("triton" if on else "cublas")
            assert engine.kernels.decode_norms == (norms if on else "off")
            prompts = random_prompts(6, seed=2, min_len=4, max_len=16)
            scores = [engine.score(p) for p in prompts + [[5], [60]]]
            params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
            reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
            outs = {r.rid: r.output_ids for r in engine.generate(reqs)}
            lone = GenerateRequest("a", prompts[1], params)
            alone = [r.output_ids for r in engine.generate([lone])]
            return scores, [outs[str(i)] for i in range(len(prompts))] + alone
        finally:
            del engine
            gc.collect()
            torch.cuda.empty_cache()

    ref_scores, ref_tokens = run(False)
    scores, tokens = run(True)
    for got, want in zip(scores, ref_scores):
        rel = ((got - want).norm() / want.norm()).item()
        assert rel <= 2e-2, rel
    first = [a[0] == b[0] for a, b in zip(tokens, ref_tokens)]
    assert sum(first) >= len(first) - 1, (tokens, ref_tokens)
