"""The FP8 quantization kernels (kernels/fp8_quant.py) under Triton's CPU interpreter, against
torch references, and QuantMatmul's scaled_mm path running them.

Skipped where triton is not installed. The checks run in a subprocess (TRITON_INTERPRET must be
set before triton is first imported).

NOTE: the interpreter's float32 -> float8e4nv cast does not carry a rounding into the exponent
(31.7 becomes 16, not 32; the GPU's cvt.rn.satfinite is exact), so on CPU tensors
kernels/fp8_quant.py rounds to e4m3 in float32 arithmetic before the cast: its FP8 bytes are
checked here against act_quant's, and its float32 output (the clamped quotients before any
rounding) too. The block matmul's checks take inputs whose quotients are FP8 values already
(every group's maximum 448 times a power of two: the scales are powers of two and the divisions
exact); tests/gpu/test_fp8_kernels_gpu.py checks the FP8 bytes on the GPU.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # CI's slow tier (BATCHRUN_SLOW_TESTS=1)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

FP8 = torch.float8_e4m3fn


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_fp8_kernels_under_interpreter():
    from triton_interpreter import run_under_interpreter

    run_under_interpreter(__file__)


def _exact_fp8_input(rows: int, cols: int, group: int, gen: torch.Generator) -> torch.Tensor:
    """x [rows, cols] whose every group of `group` columns (per row) holds FP8 values times a
    power of two, its largest magnitude exactly 448 times that power: quantization is exact."""
    q = (torch.randn(rows, cols, generator=gen) * 100).clamp(-440, 440).to(FP8).float()
    num_groups = -(-cols // group)
    q.view(-1)[:: group // 2] = 448.0  # a 448 in every group of every row
    powers = torch.randint(-8, 4, (rows, num_groups), generator=gen).float()
    return q * torch.exp2(powers).repeat_interleave(group, 1)[:, :cols]


def _check_quant_per_token():
    from batchrun.kernels import fp8_quant

    from batchrun.quant.act_quant import quant_per_token

    gen = torch.Generator().manual_seed(0)
    # one block, a power of two, the chunked path past MAX_ROW_BLOCK
    for cols in (300, 4096, fp8_quant.MAX_ROW_BLOCK + 1000):
        x = torch.randn(5, cols, generator=gen) * 3
        x[2] = 0.0  # an all-zero row: scale MIN_SCALE, zeros
        q, scale = fp8_quant.quant_per_token(x, out_dtype=torch.float32)
        want_q, want_scale = quant_per_token(x)
        assert scale.shape == (5, 1) and torch.equal(scale, want_scale), cols
        assert torch.equal(q.to(FP8).view(torch.uint8), want_q.view(torch.uint8)), cols
        # a given amax (a row-parallel layer's, over more columns) sets the scale
        amax = x.abs().amax(dim=-1, keepdim=True) * 2
        q, scale = fp8_quant.quant_per_token(x, amax, out_dtype=torch.float32)
        want_q, want_scale = quant_per_token(x, lambda t, a=amax: torch.maximum(t, a))
        assert torch.equal(scale, want_scale), cols
        assert torch.equal(q.to(FP8).view(torch.uint8), want_q.view(torch.uint8)), cols
    # FP8 output bytes: bf16 input on exact quotients (one group = the whole row), and random
    # bf16 / fp16 rows (ties and subnormals rounded by the kernel's own arithmetic here)
    exact = _exact_fp8_input(7, 512, 512, gen).to(torch.bfloat16)
    randoms = ((torch.randn(6, 700, generator=gen) * 5).bfloat16(), torch.randn(3, 64).half())
    for x in (exact, *randoms):
        q, scale = fp8_quant.quant_per_token(x)
        want_q, want_scale = quant_per_token(x)
        assert q.dtype == FP8 and torch.equal(scale, want_scale)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def _check_quant_static():
    from batchrun.kernels import fp8_quant

    from batchrun.quant.act_quant import quant_static

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 200, generator=gen) * 20  # some beyond 448 * scale: clamped
    scale = torch.tensor(0.03)
    q, rows = fp8_quant.quant_static(x, scale, out_dtype=torch.float32)
    assert rows.shape == (6, 1) and bool((rows == scale).all())
    want = quant_static(x, scale)
    assert torch.equal(q.to(FP8).view(torch.uint8), want.view(torch.uint8))
    assert float(q.abs().max()) == 448.0
    q, _ = fp8_quant.quant_static(x, scale)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))


def _check_quant_per_token_group():
    from batchrun.kernels import fp8_quant

    gen = torch.Generator().manual_seed(2)
    for rows, cols in ((1, 256), (5, 300), (70, 512)):  # both BLOCK_M, a partial last group
        x = torch.randn(rows, cols, generator=gen) * 3
        x[0, :128] = 0.0  # an all-zero group
        q, scale = fp8_quant.quant_per_token_group(x, 128, out_dtype=torch.float32)
        groups = -(-cols // 128)
        assert scale.shape == (rows, groups) and scale.stride() == (1, rows)
        padded = torch.nn.functional.pad(x, (0, groups * 128 - cols)).view(rows, groups, 128)
        want_scale = (padded.abs().amax(-1) * (1.0 / 448.0)).clamp(min=1e-12)
        assert torch.equal(scale, want_scale), (rows, cols)
        want_q = (padded / want_scale[..., None]).clamp(-448, 448).view(rows, -1)[:, :cols]
        assert torch.equal(q, want_q), (rows, cols)
    x = _exact_fp8_input(9, 384, 128, gen).to(torch.bfloat16)
    q, scale = fp8_quant.quant_per_token_group(x, 128)
    assert q.dtype == FP8
    back = q.float() * scale.repeat_interleave(128, 1)
    assert torch.equal(back, x.float())


def _check_quant_matmul_paths():
    """QuantMatmul's scaled_mm path with the Triton quantization, against the dequantized
    weights times the exactly quantized activations (the block path runs cuBLASLt's block
    matmul: tests/gpu/test_fp8_kernels_gpu.py)."""
    from batchrun.quant.linear import QuantMatmul, QuantSpec
    from batchrun.quant.quantize import quantize_fp8

    gen = torch.Generator().manual_seed(4)
    w = torch.randn(256, 384, generator=gen) * 0.02
    # scaled_mm (torch's CPU implementation) fed by kernels/fp8_quant.py
    x = _exact_fp8_input(5, 384, 384, gen)
    for activations, weights in (
        ("dynamic", "channel"),
        ("static", "tensor"),
        ("static", "channel"),
    ):
        input_scale = torch.tensor(2.0) if activations == "static" else None
        qw = quantize_fp8(w, weights, None, input_scale)
        spec = QuantSpec("fp8", activations, None, "scaled_mm", "test")
        m = QuantMatmul(256, 384, spec, torch.bfloat16, "cpu")
        m.load(qw, "test")
        m.triton_quant = True  # as on CUDA
        got = m(x.to(torch.bfloat16))
        xq = x if input_scale is None else (x / 2.0).clamp(-448, 448).to(FP8).float() * 2.0
        want = xq @ qw.dequantize().T
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * float(want.std()))
    # a row-parallel layer: the per-token maximum taken over the other rank's columns too
    qw = quantize_fp8(w, "channel")
    spec = QuantSpec("fp8", "dynamic", None, "scaled_mm", "test")
    halves = []
    for lo, hi in ((0, 192), (192, 384)):
        other = torch.cat([x[:, :lo], x[:, hi:]], dim=1).abs().amax(dim=-1, keepdim=True)
        m = QuantMatmul(
            256, 192, spec, torch.bfloat16, "cpu", lambda t, o=other: torch.maximum(t, o)
        )
        m.load(qw.narrow_in(lo, hi - lo), "test")
        m.triton_quant = True
        halves.append(m(x[:, lo:hi].to(torch.bfloat16)).float())
    want = x @ qw.dequantize().T
    torch.testing.assert_close(
        halves[0] + halves[1], want, rtol=2e-2, atol=2e-2 * float(want.std())
    )


def _run_checks():
    _check_quant_per_token()
    _check_quant_static()
    _check_quant_per_token_group()
    _check_quant_matmul_paths()
    print("ok")


if __name__ == "__main__":
    _run_checks()
