"""kernels/fp8_gemv.py on the GPU (sm_89+): against quant_per_token / quant_static +
torch._scaled_mm (the same quantized operands: equal up to the order of accumulation) and against
the dequantized fp32 reference, M = 1..16 on the llama-8b and llama-1b projections, dynamic and
static activations, the SwiGLU epilogue; in a CUDA graph with PDL; and
engines on FP8 checkpoints whose decode batches run the kernel giving the scaled_mm path's greedy
tokens.

    pytest tests/gpu/test_fp8_gemv_gpu.py -q
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from batchrun.config import EngineConfig, KernelPlan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs an sm_89+ GPU (FP8)",
    ),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
MS = tuple(range(1, 17))
# against torch._scaled_mm on the same operands: both round an fp32 sum to bf16 once (half an
# ulp, 2^-9 relative, each), the sums differ only by the order of accumulation
ULP_BOUND = 2.0**-7
# against the dequantized fp32 product with unquantized activations: test_fp8_gpu.py's bound
BF16_BOUND = 8e-3


def _weights(n: int, k: int):
    """(w float8 [N, K], sw float32 [N], the dequantized fp32 weight)."""
    w = torch.randn(n, k, device="cuda") * 0.02
    sw = w.abs().amax(dim=1) / 448.0
    q = (w / sw[:, None]).to(torch.float8_e4m3fn)
    return q, sw, q.float() * sw[:, None]


def _scaled_mm(x, w, sw, input_scale=None):
    """The scaled_mm path's product: quant_per_token / quant_static, then torch._scaled_mm."""
    from batchrun.quant.act_quant import quant_per_token, quant_static

    if input_scale is None:
        xq, sx = quant_per_token(x)
    else:
        xq, sx = quant_static(x, input_scale), input_scale.reshape(1, 1).repeat(x.shape[0], 1)
    return torch._scaled_mm(
        xq, w.t(), scale_a=sx, scale_b=sw.reshape(1, -1), out_dtype=torch.bfloat16
    )


def _close_to(got, want, what, roundings: int = 1):
    """Elementwise within ULP_BOUND of want per rounding the result went through (the SwiGLU
    epilogue's three: gate, silu, up, each of which may land one bf16 step apart on fp32 sums
    that differ in their last bits), with a floor at 1e-3 of the output's scale (where a
    different order of accumulation cancels differently)."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    g, r = got.float(), want.float()
    bound = roundings * ULP_BOUND * r.abs() + 1e-3 * r.abs().max()
    bad = int(((g - r).abs() > bound).sum())
    assert bad == 0, f"{what}: {bad} elements off (max diff {float((g - r).abs().max()):.3g})"


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_fp8_gemv_matches_scaled_mm_and_the_dequantized_reference(shape, activations):
    from batchrun.kernels.fp8_gemv import fp8_gemv, pick_config

    torch.manual_seed(0)
    n, k = SHAPES[shape]
    w, sw, w_ref = _weights(n, k)
    s = torch.tensor(0.02, device="cuda") if activations == "static" else None
    for m in MS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        what = f"{shape} M={m} {activations}"
        got = fp8_gemv(x, w, sw, s)
        _close_to(got, _scaled_mm(x, w, sw, s), what)
        xf = x.float()
        if s is None:
            sx = (xf.abs().amax(dim=-1, keepdim=True) * (1.0 / 448.0)).clamp(min=1e-12)
        else:
            sx = s
        xq = (xf / sx).clamp(-448, 448).to(torch.float8_e4m3fn).float() * sx
        want = xq @ w_ref.t()
        rel = float((got.float() - want).norm() / want.norm())
        assert rel <= BF16_BOUND, f"{what}: relative error {rel:.2e}"
        if s is None:  # other tiles and splits of the benchmark's sweep
            cfg = pick_config(m, n, k)
            for variant in (
                cfg._replace(block_n=128, block_k=256, split_k=2),
                cfg._replace(block_k=512, split_k=1),
            ):
                _close_to(fp8_gemv(x, w, sw, config=variant), got, f"{what} {variant}")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_block_fp8_matches_the_dequantized_reference(shape):
    """Block FP8 (128 x 128 weight blocks, activations per 128-column group) against the
    dequantized operands' fp32 matmul in bf16, and the SwiGLU epilogue of a gate_up against it
    then the gate."""
    import torch.nn.functional as F
    from batchrun.kernels.fp8_gemv import fp8_gemv
    from batchrun.kernels.fp8_quant import quant_per_token_group

    from batchrun.quant.quantize import quantize_fp8

    torch.manual_seed(0)
    n, k = SHAPES[shape]
    qw = quantize_fp8(torch.randn(n, k, device="cuda") * 0.02, "block", (128, 128))
    for m in MS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        xq, sx = quant_per_token_group(x, 128)
        x_ref = xq.float() * sx.repeat_interleave(128, 1)[:, :k]
        want = (x_ref @ qw.dequantize().T).bfloat16()
        what = f"{shape} M={m} blocks"
        _close_to(fp8_gemv(x, qw.weight, qw.scale, blocks=True), want, what)
        if shape.endswith("gate_up"):
            gate, up = want.chunk(2, dim=-1)
            gated = (F.silu(gate.float()).to(torch.bfloat16).float() * up.float()).bfloat16()
            got = fp8_gemv(x, qw.weight, qw.scale, blocks=True, swiglu=True)
            _close_to(got, gated, what + " swiglu", roundings=3)


@pytest.mark.parametrize("shape", ["8b-gate_up", "1b-gate_up"])
def test_the_swiglu_epilogue_matches_scaled_mm_then_the_gate(shape):
    import torch.nn.functional as F
    from batchrun.kernels.fp8_gemv import fp8_gemv

    torch.manual_seed(0)
    n, k = SHAPES[shape]
    w, sw, _ = _weights(n, k)
    for m in (1, 4, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        gate, up = _scaled_mm(x, w, sw).chunk(2, dim=-1)
        want = (F.silu(gate.float()).to(torch.bfloat16).float() * up.float()).bfloat16()
        _close_to(fp8_gemv(x, w, sw, swiglu=True), want, f"{shape} M={m}", roundings=3)


@pytest.mark.parametrize("static", [False, True])
def test_fp8_gemv_replays_in_a_cuda_graph_with_pdl(static):
    """Captured after one eager call (the split counters), replayed on new inputs: the same
    bits as eager (split-K sums its planes in slice order)."""
    from batchrun.kernels.fp8_gemv import fp8_gemv

    from batchrun.engine.kernel_choice import supports_pdl

    torch.manual_seed(0)
    pdl = supports_pdl(torch.device("cuda"))
    w, sw, _ = _weights(4096, 4096)
    w2, sw2, _ = _weights(2 * 1024, 4096)
    s = torch.tensor(0.05, device="cuda") if static else None
    x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)

    def chain(x):
        h = fp8_gemv(x, w, sw, s, pdl=pdl)  # split along K (64 column tiles)
        return fp8_gemv(h, w2, sw2, s, swiglu=True, pdl=pdl)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, chain(x), rtol=0, atol=0)


# -- engines ------------------------------------------------------------------------------------


def _generate(config: EngineConfig, kernels: KernelPlan) -> list[list[int]]:
    from tiny_models import random_prompts

    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(24, seed=5, min_len=4, max_len=100)
    engine = Engine(config, kernels)
    assert engine.kernels.fp8_matmul == "scaled_mm"
    outs = {r.rid: r.output_ids for r in engine.generate(
        [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    )}  # fmt: skip
    engine.check_integrity()
    return [outs[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("fmt", ["ct-fp8-channel", "modelopt-fp8", "online", "fp8-block"])
def test_decode_on_fp8_gemv_gives_the_scaled_mm_tokens(fmt, tmp_path):
    """Graphs on, decode batches of up to 16 rows on kernels/fp8_gemv.py (decode_gemv
    "triton") against every matmul on torch._scaled_mm or the block matmul (decode_gemv
    "cublas"): the same quantized operands, summed in another order, so the same greedy tokens
    (a request may part at a near-tie: at least 22 of the 24 identical)."""
    from quant_checkpoints import make_fp32_model, write_quantized

    kw = {}
    if fmt == "online":
        make_fp32_model("llama").save_pretrained(tmp_path)
        kw["quantization"] = "fp8"
    else:
        write_quantized(fmt, "llama", tmp_path)
    base = dict(
        model=str(tmp_path), device="cuda", dtype="bfloat16", kv_budget=20000, max_running=32, **kw
    )
    # block FP8 keeps its blocks (fp8_matmul "auto" dequantizes a model that fits where
    # cuBLASLt's block matmul does not run): decode on the block-scaled GEMV against the block
    # matmul (cuBLASLt's on sm_90 with a CUDA 12.9+ torch)
    kernels = KernelPlan(fp8_matmul="scaled_mm")
    gemv = _generate(EngineConfig(**base), replace(kernels, decode_gemv="triton"))
    scaled_mm = _generate(EngineConfig(**base), replace(kernels, decode_gemv="cublas"))
    same = sum(a == b for a, b in zip(gemv, scaled_mm))
    print(f"{fmt}: {same} of {len(gemv)} requests identical")
    assert same >= 22, f"{fmt}: {same} of {len(gemv)} requests identical"
