"""kernels/int4_matmul.py under Triton's CPU interpreter, against Int4Weight.dequantize() and
F.linear: both shapes of int4_matmul (decode: split-K, act-order's x gathered in the kernel;
prefill: several row tiles, x gathered by index_select), on weights in either order (plain, and
mma_pack's of the tensor-core decode GEMV), every group size, symmetric and asymmetric,
act-order, a tensor-parallel slice of an act-order weight (each column's group read); the
QuantMatmul that runs it; and a tiny AWQ and GPTQ act-order model whose engine gives the
dequantized path's logits and greedy tokens.

Skipped where triton is not installed. The interpreter's tl.dot is wrong for bf16 inputs (a
triton limitation), so the activations here are fp32 and fp16; tests/gpu covers bf16.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.slow  # CI's slow tier (BATCHRUN_SLOW_TESTS=1)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

# (format, group size, symmetric, act-order)
CASES = [
    ("awq", 32, False, False),
    ("awq", 128, False, False),
    ("gptq", 64, True, True),
    ("gptq", 32, False, True),
    ("gptq", -1, True, False),
    ("pack-quantized", 128, True, False),
    ("pack-quantized", -1, False, False),
]
OUT, IN = 72, 256
# decode (split-K at 16 and 33 rows), prefill (two row tiles, a partial one)
ROWS = (1, 5, 16, 33, 200)
# fp32: the dequantized weight is exact and the kernel's sums are fp32 (only their order
# differs); fp16: the same weight rounded to fp16 as dequantize(fp16) rounds it, and y rounded
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_int4_kernel_under_interpreter():
    from triton_interpreter import run_under_interpreter

    run_under_interpreter(__file__)


def decoded(fmt: str, group_size: int, symmetric: bool, act_order: bool, out=OUT, inp=IN):
    """A random weight quantized by the tests' reference quantizer, stored in `fmt`'s layout and
    decoded by batchrun's format module (an Int4Weight)."""
    from quant_checkpoints_int4 import (
        int4_quantization_config,
        int4_tensors,
        quantize_int4,
        reference_g_idx,
    )

    from batchrun.quant.formats import awq, compressed_tensors_int4, gptq

    parse = {"awq": awq.parse, "gptq": gptq.parse, "pack-quantized": compressed_tensors_int4.parse}
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(3)) * 0.05
    ref = quantize_int4(
        w, group_size, symmetric, torch.float16, reference_g_idx(inp, group_size, act_order, 4)
    )
    scheme = parse[fmt](int4_quantization_config(fmt, group_size, symmetric, act_order), "test")
    tensors = int4_tensors(fmt, ref, act_order=act_order)
    return scheme.decode(tensors, out, inp, "model.layers.0.mlp.down_proj")


def check(w, m: int, dtype, what: str, mma: bool = False, **kwargs) -> None:
    """int4_matmul on w packed (mma: in Int4MmaPacked's order) against F.linear."""
    from batchrun.kernels.int4_matmul import int4_matmul

    from batchrun.quant.int4_layout import mma_pack, pack_int4

    x = torch.randn(m, w.in_features, generator=torch.Generator().manual_seed(m)).to(dtype)
    packed = mma_pack(pack_int4(w)) if mma else pack_int4(w)
    y = int4_matmul(x, packed, **kwargs)
    ref = F.linear(x.double(), w.dequantize(dtype).double())
    err = float((y.double() - ref).abs().max() / ref.abs().max())
    assert y.dtype == dtype and y.shape == (m, w.out_features), what
    assert err <= TOLERANCE[dtype], (what, m, dtype, err)


def check_kernel() -> None:
    from batchrun.kernels.int4_matmul import Int4Config

    for case in CASES:
        w = decoded(*case)
        for dtype in (torch.float32, torch.float16):
            for m in ROWS:
                check(w, m, dtype, f"{case}")
        # a tensor-parallel rank's columns (row-parallel): act-order leaves groups uneven
        for rank in range(2):
            part = w.narrow_in(rank * IN // 2, IN // 2)
            for m in (3, 100):
                check(part, m, torch.float32, f"{case} rank {rank}")
    w = decoded("gptq", 32, False, True)
    # configs of other shapes: narrow column tiles, split-K by hand, 64-row decode tiles
    for cfg, split in ((Int4Config(16, 32, 64, 4, 2), 4), (Int4Config(64, 64, 32, 4, 2), 2)):
        check(w, 7, torch.float16, f"{cfg} split {split}", config=cfg, split_k=split)
    check_mma_order()


def check_mma_order() -> None:
    """int4_matmul reading Int4MmaPacked's order (what an engine layer keeps where the tensor-
    core decode GEMV takes it): groups of 64, 128 and one a row, symmetric and not, decode
    (split-K) and prefill rows, a K of 320 (a 128-deep tile's second step past K) and of 384, narrow
    tiles by hand (widened to whole 64-deep steps)."""
    from batchrun.kernels.int4_matmul import Int4Config

    for case, long_k in ((("awq", 128, False, False), 384), (("gptq", 64, True, False), 320),
                         (("pack-quantized", -1, False, False), 320)):  # fmt: skip
        for inp in (256, long_k):
            w = decoded(*case, out=144, inp=inp)
            for dtype in (torch.float32, torch.float16):
                for m in ROWS:
                    check(w, m, dtype, f"mma order {case} {inp}", mma=True)
    w = decoded("gptq", 64, False, False, out=144, inp=320)
    check(w, 7, torch.float16, "mma narrow", mma=True, config=Int4Config(16, 16, 32, 4, 2))


def check_quant_matmul() -> None:
    """QuantMatmul with kernel "int4": the packed buffers, any leading shape (every batch on
    int4_matmul on the CPU, where the tensor-core decode GEMV's order is not kept; an act-order
    weight's too), the dense path's result."""
    from unittest import mock

    from batchrun.kernels import int4_matmul

    from batchrun.quant.linear import QuantMatmul, QuantSpec

    out = 80  # a gate_up of whole words a half
    act_order = QuantMatmul(out, IN, QuantSpec("int4", "none", None, "int4", "test"),
                            torch.float32, "cpu")  # fmt: skip
    act_order.load(decoded("gptq", 64, False, True, out=out), "test")
    x = torch.randn(6, IN, generator=torch.Generator().manual_seed(2))
    assert not act_order.takes_gemv(x)
    with mock.patch.object(int4_matmul, "int4_matmul", wraps=int4_matmul.int4_matmul) as spy:
        act_order(x)
    assert spy.call_count == 1
    w = decoded("gptq", 64, False, False, out=out)
    layers = {}
    for kernel in ("int4", "dense"):
        spec = QuantSpec("int4", "none", None, kernel, "test")
        layers[kernel] = QuantMatmul(out, IN, spec, torch.float32, "cpu")
        layers[kernel].load(w, "test")
    for rows in (6, 40):
        x = torch.randn(2, rows // 2, IN, generator=torch.Generator().manual_seed(0))
        assert not layers["int4"].takes_gemv(x.view(rows, IN))
        with mock.patch.object(int4_matmul, "int4_matmul", wraps=int4_matmul.int4_matmul) as spy:
            ours = layers["int4"](x)
        assert spy.call_count == 1, rows
        torch.testing.assert_close(ours, layers["dense"](x), rtol=1e-5, atol=1e-5)


def check_engine() -> None:
    """A tiny Llama in AWQ and in GPTQ with act-order: the engine on the kernel gives the
    dequantized path's logits (fp32) and greedy tokens."""
    from quant_checkpoints_int4 import write_int4_checkpoint
    from tiny_models import make_hf_config, random_prompts
    from transformers import AutoModelForCausalLM

    from batchrun.config import EngineConfig, KernelPlan
    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(make_hf_config("llama"), dtype=torch.float32).eval()
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(3, seed=1)
    for fmt, act_order in (("awq", False), ("gptq", True)):
        with tempfile.TemporaryDirectory() as tmp:
            write_int4_checkpoint(fmt, hf, Path(tmp), group_size=32, act_order=act_order)
            results = {}
            for path in ("triton", "dequant"):
                kernels = replace(KernelPlan.reference(), int4_matmul=path)
                cfg = EngineConfig(model=tmp, device="cpu", dtype="float32")
                engine = Engine(cfg, kernels=kernels)
                layer = engine.runner.model.layers[0].mlp.down_proj.quant
                assert layer.spec.kernel == ("int4" if path == "triton" else "dense")
                reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
                tokens = {r.rid: r.output_ids for r in engine.generate(reqs)}
                results[path] = (tokens, engine.score(prompts[0]))
            assert results["triton"][0] == results["dequant"][0], fmt
            torch.testing.assert_close(
                results["triton"][1], results["dequant"][1], rtol=1e-5, atol=1e-5
            )


if __name__ == "__main__":
    check_kernel()
    check_quant_matmul()
    check_engine()
    print("ok")
