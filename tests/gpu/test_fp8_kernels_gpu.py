"""The FP8 Triton kernels on the GPU (sm_89+): activation quantization (kernels/fp8_quant.py)
against act_quant.py's torch ops, the block linear on cuBLASLt's block-scaled matmul against
the fake-quantized reference and in a CUDA graph, and engines on a block-FP8 checkpoint.

    pytest tests/gpu/test_fp8_kernels_gpu.py -q          (about a minute on an H200)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchrun.config import EngineConfig, KernelPlan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs an sm_89+ GPU (FP8 tensor cores)",
    ),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FP8 = torch.float8_e4m3fn
MS = (1, 3, 16, 64, 255, 1024, 8192)
# (N, K) of the llama-8b and llama-1b projections: qkv, o, gate_up, down
SHAPES = {
    "8b-qkv": (6144, 4096),
    "8b-o": (4096, 4096),
    "8b-gate_up": (28672, 4096),
    "8b-down": (4096, 14336),
    "1b-qkv": (3072, 2048),
    "1b-o": (2048, 2048),
    "1b-gate_up": (16384, 2048),
    "1b-down": (2048, 8192),
}
# bf16 output against the fp32 reference on the same quantized operands: the tensor cores sum
# 128 products per block in (at least) fp32-like precision, the bf16 rounding is 2^-8 relative
BF16_BOUND = 8e-3
# Hopper's FP8 wgmma (the kernel's 64-row and larger tiles) sums its products with fewer than
# fp32's mantissa bits: on the H200 an fp32-out block linear at M = 100 reads 1.28e-4 against
# the fp32 reference (mma.sync's 16-row tiles stay within 1e-5)
WGMMA_FP32_BOUND = 5e-4


def _same_bytes_up_to_rounding(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """FP8 tensors equal, except where a quotient at a rounding tie lands one FP8 step away
    (at most 1e-4 of the elements)."""
    a, b = got.view(torch.uint8).int(), want.view(torch.uint8).int()
    diff = (a - b).abs()
    assert int(diff.max()) <= 1, f"{what}: FP8 codes differ by {int(diff.max())}"
    frac = float((diff > 0).float().mean())
    assert frac <= 1e-4, f"{what}: {frac:.2e} of the FP8 values differ"


@pytest.mark.parametrize("cols", [2048, 4096, 8192, 14336, 20000])
def test_per_token_and_static_quantization_match_the_torch_ops(cols):
    from batchrun.kernels import fp8_quant

    from batchrun.quant.act_quant import quant_per_token, quant_static

    torch.manual_seed(0)
    for num in MS:
        x = torch.randn(num, cols, device="cuda", dtype=torch.bfloat16) * 4
        x[0] = 0  # an all-zero row
        q, scale = fp8_quant.quant_per_token(x)
        want_q, want_scale = quant_per_token(x)
        assert q.dtype == FP8 and scale.shape == (num, 1)
        torch.testing.assert_close(scale, want_scale, rtol=0, atol=0)
        _same_bytes_up_to_rounding(q, want_q, f"per token M={num} K={cols}")
        amax = x.float().abs().amax(dim=-1, keepdim=True) * 1.5  # a row-parallel layer's
        q, scale = fp8_quant.quant_per_token(x, amax)
        want_q, want_scale = quant_per_token(x, lambda t, a=amax: torch.maximum(t, a))
        torch.testing.assert_close(scale, want_scale, rtol=0, atol=0)
        _same_bytes_up_to_rounding(q, want_q, f"given amax M={num} K={cols}")
        static = torch.tensor(0.01, device="cuda")  # some values past 448 * scale: clamped
        q, rows = fp8_quant.quant_static(x, static)
        assert bool((rows == static).all())
        _same_bytes_up_to_rounding(q, quant_static(x, static), f"static M={num} K={cols}")


@pytest.mark.parametrize("cols", [2048, 4096, 14336])
def test_per_token_group_quantization_matches_the_reference(cols):
    from batchrun.kernels import fp8_quant

    torch.manual_seed(1)
    for num in MS:
        x = torch.randn(num, cols, device="cuda", dtype=torch.bfloat16) * 4
        q, scale = fp8_quant.quant_per_token_group(x, 128)
        xg = x.float().view(num, cols // 128, 128)
        want_scale = (xg.abs().amax(-1) * (1.0 / 448.0)).clamp(min=1e-12)
        want_q = (xg / want_scale[..., None]).clamp(-448, 448).to(FP8).view(num, cols)
        assert scale.shape == (num, cols // 128) and scale.stride() == (1, num)
        torch.testing.assert_close(scale, want_scale, rtol=0, atol=0)
        _same_bytes_up_to_rounding(q, want_q, f"groups M={num} K={cols}")


def _block_weight(out_features: int, in_features: int):
    from batchrun.quant.quantize import quantize_fp8

    w = torch.randn(out_features, in_features, device="cuda") * 0.02
    return quantize_fp8(w, "block", (128, 128))


def _needs_cublaslt() -> None:
    """Skip where cuBLASLt's block matmul does not run (the plan keeps such a model off it)."""
    from batchrun.engine.kernel_choice import supports_block_scaled_mm

    if not supports_block_scaled_mm(torch.device("cuda")):
        pytest.skip("cuBLASLt's block-scaled matmul needs sm_90 and a torch with CUDA 12.9+")


def test_block_linear_matches_the_fake_quantized_reference():
    """QuantMatmul on a block-FP8 weight (kernel "fp8_block", as plan_linear picks it on
    CUDA) against act_quant's fake quantization of x times the dequantized weight, in fp32,
    on cuBLASLt's block matmul (which pads x to a multiple of 4 rows: M = 3, 101)."""
    from batchrun.quant.act_quant import fake_quant_dynamic
    from batchrun.quant.linear import QuantMatmul, QuantSpec

    _needs_cublaslt()
    torch.manual_seed(3)
    kernels = KernelPlan.reference()
    spec = QuantSpec("fp8", "dynamic", (128, 128), "fp8_block", "test")
    for out_f, in_f in ((3072, 2048), (4096, 14336), (208, 384)):
        qw = _block_weight(out_f, in_f)
        for dtype, bound in ((torch.bfloat16, BF16_BOUND), (torch.float32, WGMMA_FP32_BOUND)):
            m = QuantMatmul(out_f, in_f, spec, dtype, torch.device("cuda"), kernels=kernels)
            m.load(qw, "test")
            for num in (1, 3, 101, 1000):
                x = torch.randn(2, num, in_f, device="cuda", dtype=dtype)
                got = m(x)
                assert got.shape == (2, num, out_f) and got.dtype == dtype
                xf = fake_quant_dynamic(x.float().reshape(-1, in_f), 128)
                want = F.linear(xf, qw.dequantize()).view(2, num, out_f)
                rel = float((got.float() - want).norm() / want.norm())
                assert rel <= bound, f"{dtype} {out_f}x{in_f} M={num}: error {rel:.2e}"


def test_the_block_linear_replays_in_a_cuda_graph():
    """No host sync and no data-dependent shape: captured once, replayed on new inputs."""
    from batchrun.quant.linear import QuantMatmul, QuantSpec

    _needs_cublaslt()
    torch.manual_seed(4)
    kernels = KernelPlan.reference()
    spec = QuantSpec("fp8", "dynamic", (128, 128), "fp8_block", "test")
    m = QuantMatmul(512, 256, spec, torch.bfloat16, torch.device("cuda"), kernels=kernels)
    m.load(_block_weight(512, 256), "test")
    x = torch.randn(37, 256, device="cuda", dtype=torch.bfloat16)  # padded to 40 rows
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        m(x)  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = m(x)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, m(x), rtol=0, atol=0)


# -- engines ------------------------------------------------------------------------------------


def _block_kernels(engine) -> set[str]:
    from batchrun.quant.linear import QuantMatmul

    return {m.spec.kernel for m in engine.runner.model.modules() if isinstance(m, QuantMatmul)}


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-fp8-block"])
def test_block_fp8_engine_gives_the_exact_models_tokens(fmt, tmp_path):
    """A block-FP8 checkpoint in fp32 on CUDA (the Triton kernels, CUDA graphs and piecewise
    graphs on) against the CPU's exact model of it (fp32, activations fake-quantized as the
    kernels quantize them): over the CUDA engine's 32 greedy tokens of 8 prompts, teacher-
    forced, the CPU engine picks the same token at least 80 % of the time (on sm_90 its
    prefill rows run on cuBLASLt's block matmul, fp32 out). The sums differ:
    their order, and the FP8 wgmma's narrower accumulator (WGMMA_FP32_BOUND); on this tiny
    random model (flat logits) that moves picks: the CPU engine scoring its own greedy tokens
    agrees on 252 of 256, the CUDA engine's on 225 of 256 on the H200. The bf16 engine runs
    the same kernels."""
    from quant_checkpoints import write_quantized
    from tiny_models import random_prompts

    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    agreement_floor = 0.8
    write_quantized(fmt, "llama", tmp_path)
    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(8, seed=5, min_len=4, max_len=100)
    base = dict(model=str(tmp_path), kv_budget=20000, max_running=16)
    cuda = Engine(
        EngineConfig(**base, device="cuda", dtype="float32"),
        kernels=KernelPlan(piecewise_graphs=True, fp8_matmul="scaled_mm"),
    )
    assert cuda.kernels.fp8_matmul == "scaled_mm" and _block_kernels(cuda) == {"fp8_block"}
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    outs = {r.rid: r.output_ids for r in cuda.generate(reqs)}
    cpu = Engine(EngineConfig(**base, device="cpu", dtype="float32", overlap=False))
    same = total = 0
    for req in reqs:
        ids = req.input_ids + outs[req.rid]
        picks = cpu.score(ids)[len(req.input_ids) - 1 : -1].argmax(-1).tolist()
        same += sum(a == b for a, b in zip(picks, outs[req.rid]))
        total += len(picks)
    assert same / total >= agreement_floor, f"{same} of {total} tokens agree"
    bf16 = Engine(
        EngineConfig(**base, device="cuda", dtype="bfloat16"),
        kernels=KernelPlan(fp8_matmul="scaled_mm"),
    )
    assert _block_kernels(bf16) == {"fp8_block"}
    from batchrun.engine.kernel_choice import supports_block_scaled_mm

    auto = Engine(EngineConfig(**base, device="cuda", dtype="bfloat16"))
    # kept in FP8 on cuBLASLt's block matmul where it runs; else, as the bf16 weights fit,
    # dequantized at load
    cublaslt = supports_block_scaled_mm(torch.device("cuda"))
    assert _block_kernels(auto) == ({"fp8_block"} if cublaslt else {"dense"})
    assert all(len(r.output_ids) == 32 for r in bf16.generate(reqs))
