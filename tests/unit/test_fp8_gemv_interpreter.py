"""kernels/fp8_gemv.py under Triton's CPU interpreter, against quant_per_token / quant_static and
the exact fp32 product of the quantized operands.

The interpreter's float-to-e4m3 cast truncates where it should carry into the exponent, so on
CPU tensors kernels/fp8_quant.py rounds to e4m3 in fp32 arithmetic (`_round_e4m3`) and casts the
exact value; the GPU's cast (cvt.rn.satfinite) is covered by tests/gpu/test_fp8_gemv_gpu.py.
fp16 activations compare exactly where the sums are exact, bf16 ones within one bf16 ulp (the
interpreter's fp32-to-bf16 store truncates).
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # CI's slow tier (BATCHRUN_SLOW_TESTS=1)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_fp8_gemv_under_interpreter():
    from triton_interpreter import run_under_interpreter

    run_under_interpreter(__file__)


def _weights(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(w float8 [N, K], sw float32 [N]): per-channel quantized random weights."""
    from batchrun.quant.weights import FP8_DTYPE, FP8_MAX

    w = torch.randn(n, k, generator=gen) * 0.05
    sw = w.abs().amax(dim=1) / FP8_MAX
    return (w / sw[:, None]).to(FP8_DTYPE), sw


def _reference(x, w, sw, input_scale=None, swiglu=False):
    """fp32 of q(x) @ w.T scaled, as quant_per_token / quant_static + torch._scaled_mm compute
    it, then rounded to x's dtype (the SwiGLU gate as the unfused path rounds it)."""
    from batchrun.quant.act_quant import quant_per_token, quant_static

    if input_scale is None:
        xq, sx = quant_per_token(x)
    else:
        xq, sx = quant_static(x, input_scale), input_scale.reshape(1, 1)
    y = (xq.double() @ w.double().t()).float() * sw[None, :] * sx
    if not swiglu:
        return y.to(x.dtype)
    gate, up = y.to(x.dtype).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)


def _check(out, ref, what, exact_share=0.99, ulps=1):
    """Within `ulps` of the dtype, relative (a floor at 1e-3), and at least `exact_share` of the
    elements identical."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, what
    ulp = 2.0**-7 if out.dtype == torch.bfloat16 else 2.0**-10
    err = ((out.float() - ref.float()).abs() / ref.float().abs().clamp(min=1e-3)).max().item()
    assert err <= 1.01 * ulps * ulp, f"{what}: relative error {err:.3g}"
    same = (out == ref).float().mean().item()
    assert same >= exact_share, f"{what}: {same:.3f} identical"


def _check_quantization(gen):
    """An identity weight: y = q(x) * sx exactly, so every element's e4m3 rounding shows
    (subnormals, ties, the clamp of a static scale, an all-zero row)."""
    from batchrun.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv

    from batchrun.quant.act_quant import quant_per_token, quant_static
    from batchrun.quant.weights import FP8_DTYPE

    k = 64
    w = torch.eye(k).to(FP8_DTYPE)
    sw = torch.ones(k)
    x = torch.randn(5, k, generator=gen) * torch.logspace(-4, 1, k)[None, :]
    x[2] = 0.0  # an all-zero row: scale 1e-12, zeros out
    x[3, :8] = torch.tensor([448.0, 0.5, 0.5625, 0.53125, -0.59375, 2.0**-9, 3 * 2.0**-10, 1e-4])
    x = x.to(torch.float16).to(torch.float32)
    cfg = Fp8GemvConfig(block_k=32)
    out = fp8_gemv(x.half(), w, sw, config=cfg).float()
    xq, sx = quant_per_token(x)
    assert torch.equal(out, (xq.float() * sx).half().float())
    s = torch.tensor(0.004)  # x up to ~10: clamped at 448 * s
    out = fp8_gemv(x.half(), w, sw, s, config=cfg).float()
    assert torch.equal(out, (quant_static(x, s).float() * s).half().float())


def _check_matmuls(gen):
    from batchrun.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv, row_amax

    # (M, N, K, config): one tile, several tiles and K slices, tails of N and K
    cases = [
        (1, 64, 256, Fp8GemvConfig(block_k=64)),
        (3, 96, 320, Fp8GemvConfig(block_k=64, split_k=2)),
        (16, 48, 200, Fp8GemvConfig(block_k=32, split_k=3)),
        (2, 32, 4160, Fp8GemvConfig(block_n=128, block_k=256, split_k=4)),
        (16, 40, 1000, None),
        (7, 64, 256, Fp8GemvConfig(block_n=128, block_k=64)),
    ]
    for m, n, k, cfg in cases:
        w, sw = _weights(n, k, gen)
        x = torch.randn(m, k, generator=gen).half()
        x[0, 7] = 30.0  # an outlier: the other columns quantize coarsely
        what = f"M={m} N={n} K={k} {cfg}"
        ref = _reference(x, w, sw)
        _check(fp8_gemv(x, w, sw, config=cfg), ref, what)
        _check(fp8_gemv(x, w, sw, amax=row_amax(x), config=cfg), ref, what + " amax")
        s = torch.tensor(0.05)
        _check(fp8_gemv(x, w, sw, s, config=cfg), _reference(x, w, sw, s), what + " static")
        xb = x.bfloat16()
        _check(fp8_gemv(xb, w, sw, config=cfg), _reference(xb, w, sw), what + " bf16", 0.0)
    swiglu_cases = ((1, None), (5, Fp8GemvConfig(block_k=64, split_k=2)))
    for m, cfg in swiglu_cases:
        w, sw = _weights(2 * 48, 256, gen)
        x = torch.randn(m, 256, generator=gen).half()
        ref = _reference(x, w, sw, swiglu=True)
        _check(fp8_gemv(x, w, sw, config=cfg, swiglu=True), ref, f"swiglu M={m}")


def _block_reference(x, w, sw, swiglu=False):
    """fp32 sums of each 128-column group's q(x) @ w.T times the group's and the block's scales
    (kernels/fp8_quant.py's quant_per_token_group, exact under the interpreter), rounded to x's
    dtype (the SwiGLU gate as the unfused path rounds it)."""
    from batchrun.kernels.fp8_quant import quant_per_token_group

    xq, sx = quant_per_token_group(x, 128)
    k = x.shape[1]
    xd = xq.double() * sx.double().repeat_interleave(128, 1)[:, :k]
    wsc = sw.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    y = (xd @ (w.double() * wsc[: w.shape[0], :k]).t()).float()
    if not swiglu:
        return y.to(x.dtype)
    gate, up = y.to(x.dtype).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)


def _check_blocks(gen):
    """Block FP8 (128 x 128 weight blocks, activations per 128-column group): tails of N and K,
    K slices, the SwiGLU epilogue of a gate_up of whole blocks, and QuantMatmul's decode route."""
    from dataclasses import replace

    from batchrun.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv
    from triton_interpreter import INTERPRETER_KERNELS

    from batchrun.quant.linear import QuantMatmul, QuantSpec
    from batchrun.quant.quantize import quantize_fp8

    for m, n, k, cfg, swiglu in (
        (1, 200, 300, None, False),
        (5, 128, 640, Fp8GemvConfig(split_k=3), False),
        (3, 256, 256, Fp8GemvConfig(block_n=128), True),
    ):
        qw = quantize_fp8(torch.randn(n, k, generator=gen) * 0.05, "block", (128, 128))
        x = torch.randn(m, k, generator=gen).half()
        x[0, 3] = 20.0  # an outlier: its group quantizes coarsely, the others do not
        got = fp8_gemv(x, qw.weight, qw.scale, blocks=True, config=cfg, swiglu=swiglu)
        want = _block_reference(x, qw.weight, qw.scale, swiglu)
        _check(got, want, f"blocks M={m} N={n} K={k} {cfg} swiglu={swiglu}", 0.0, ulps=2)
    qw = quantize_fp8(torch.randn(256, 256, generator=gen) * 0.05, "block", (128, 128))
    spec = QuantSpec("fp8", "dynamic", (128, 128), "fp8_block", "test")
    kernels = replace(INTERPRETER_KERNELS, decode_gemv="triton")
    layer = QuantMatmul(256, 256, spec, torch.bfloat16, "cpu", kernels=kernels)
    layer.load(qw, "test")
    x = torch.randn(3, 256, generator=gen).bfloat16()
    assert layer.takes_gemv(x) and not layer.takes_gemv(torch.zeros(17, 256).bfloat16())
    _check(layer(x), _block_reference(x, qw.weight, qw.scale), "QuantMatmul blocks", 0.0)


def _check_wiring(gen):
    """A scaled_mm QuantMatmul with decode_gemv "triton" runs its decode batches (and a fused
    gate_up's SwiGLU) on the kernel; with "cublas" it does not take it."""
    from dataclasses import replace

    from triton_interpreter import INTERPRETER_KERNELS

    from batchrun.quant.linear import QuantMatmul, QuantSpec
    from batchrun.quant.quantize import quantize_fp8

    w = torch.randn(64, 128, generator=gen) * 0.05
    x = torch.randn(3, 128, generator=gen).bfloat16()
    for activations, input_scale in (("dynamic", None), ("static", torch.tensor(0.02))):
        qw = quantize_fp8(w, "channel", None, input_scale)
        spec = QuantSpec("fp8", activations, None, "scaled_mm", "test")
        kernels = replace(INTERPRETER_KERNELS, decode_gemv="triton")
        layer = QuantMatmul(64, 128, spec, torch.bfloat16, "cpu", kernels=kernels)
        layer.load(qw, "test")
        assert layer.takes_gemv(x) and not layer.takes_gemv(torch.zeros(17, 128).bfloat16())
        sw = qw.scale.float()
        _check(layer(x), _reference(x, qw.weight, sw, input_scale), activations, 0.0)
        ref = _reference(x, qw.weight, sw, input_scale, swiglu=True)
        # bf16 gate, silu and product each truncated by the interpreter's stores and casts
        _check(layer.gemv(x, swiglu=True), ref, activations + " swiglu", 0.0, ulps=4)
        plain = QuantMatmul(64, 128, spec, torch.bfloat16, "cpu", kernels=INTERPRETER_KERNELS)
        assert not plain.takes_gemv(x)


def _check_residual(gen):
    """fp8_gemv_residual (fp16): h = fp8_gemv(...) + residual bit for bit, per-channel and block
    FP8, split-K on and off; for one row the norm by the last column tile within 2 ulps of
    kernels/fused_norm.py's rms_norm of h; the counters left at zero."""
    from batchrun.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv, fp8_gemv_residual
    from batchrun.kernels.fused_norm import rms_norm
    from batchrun.kernels.gemv import split_counters

    from batchrun.quant.quantize import quantize_fp8

    cases = [(1, 256, 192, None), (1, 320, 256, Fp8GemvConfig(block_k=64, split_k=3)),
             (3, 256, 128, Fp8GemvConfig(split_k=2))]  # fmt: skip
    for (m, k, n, cfg), blocks in itertools.product(cases, (False, True)):
        if blocks:
            qw = quantize_fp8(torch.randn(n, k, generator=gen) * 0.05, "block", (128, 128))
            w, sw = qw.weight, qw.scale
            cfg = cfg and cfg._replace(block_k=128)
        else:
            w, sw = _weights(n, k, gen)
        x = torch.randn(m, k, generator=gen).half()
        residual = torch.randn(m, n, generator=gen).half()
        norm_w = (1 + 0.1 * torch.randn(n, generator=gen)).half()
        kw = {"blocks": blocks, "config": cfg}
        what = f"M={m} K={k} N={n} {cfg} blocks={blocks}"
        want_h = (fp8_gemv(x, w, sw, **kw).float() + residual.float()).half()
        h, normed = fp8_gemv_residual(x, w, sw, residual, **kw)
        assert torch.equal(h, want_h) and normed is None, what
        if m == 1:
            h, normed = fp8_gemv_residual(x, w, sw, residual, (norm_w, 1e-5), **kw)
            assert torch.equal(h, want_h), what
            want = rms_norm(want_h, norm_w, 1e-5).float()
            ulps = ((normed.float() - want).abs() / torch.finfo(torch.float16).eps
                    / want.abs().clamp(min=2.0**-14)).max().item()  # fmt: skip
            assert ulps <= 2.0, f"{what}: norm {ulps:.2f} ulps off"
        assert not split_counters(x.device).any(), what


def _check_decode_norms(root: Path) -> None:
    """The one-token decode of tiny FP8 Llamas (block FP8 in fp16; per-channel FP8 with layer
    1's down_proj left in bf16, in bf16) with decode_gemv "triton": decode_norms "all" (the
    residual adds and norms in kernels/fp8_gemv.py's epilogue, QuantMatmul.gemv_residual, two a
    layer) gives the logits of "off"; "fold-all" is refused."""
    from dataclasses import replace

    from quant_checkpoints import write_quantized
    from spies import count_calls
    from test_fused_kernels_interpreter import _runner
    from triton_interpreter import INTERPRETER_KERNELS

    from batchrun.quant.linear import QuantMatmul

    base = replace(INTERPRETER_KERNELS, attention="torch", decode_gemv="triton",
                   fp8_matmul="scaled_mm")  # fmt: skip
    for fmt, dtype in (("fp8-block", "float16"), ("ct-fp8-channel", "bfloat16")):
        path = root / fmt
        write_quantized(fmt, "llama", path)
        prompts = [[5], [60], [7, 8, 9]]
        ref_runner = _runner(path, replace(base, decode_norms="off"), dtype)
        refs = [ref_runner.all_logits(p, torch.arange(len(p))) for p in prompts]
        for mode in ("all",):
            runner = _runner(path, replace(base, decode_norms=mode), dtype)
            assert runner.model.fused.mode == mode
            fp8_adds = sum(  # the FP8 matmuls a residual follows (the rest: kernels/gemv.py's)
                proj.quant is not None
                for layer in runner.model.layers
                for proj in (layer.self_attn.o_proj, layer.mlp.down_proj)
            )
            assert fp8_adds >= 3, fp8_adds
            for prompt, ref in zip(prompts, refs):
                with pytest.MonkeyPatch.context() as mp:
                    calls = count_calls(mp, QuantMatmul, "gemv_residual")
                    got = runner.all_logits(prompt, torch.arange(len(prompt)))
                assert calls["n"] == (fp8_adds if len(prompt) == 1 else 0), (fmt, mode, calls)
                rel = ((got - ref).norm() / ref.norm()).item()
                assert rel <= 5e-3, (fmt, mode, len(prompt), rel)
        with pytest.raises(ValueError, match="folds the norms"):
            _runner(path, replace(base, decode_norms="fold-all"), dtype)


def _run_checks():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    _check_quantization(gen)
    _check_matmuls(gen)
    _check_wiring(gen)
    _check_blocks(gen)
    _check_residual(gen)
    with tempfile.TemporaryDirectory() as tmp:
        _check_decode_norms(Path(tmp))
    print("ok")


if __name__ == "__main__":
    _run_checks()
