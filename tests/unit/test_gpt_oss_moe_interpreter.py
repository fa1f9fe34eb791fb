"""gpt-oss's experts in the fused MoE (kernels/fused_moe.py, its gathered path through TMA
descriptors and the decode batches' kernels/moe_gemv.py with `extras`: gate / up and down
biases, the clamped SwiGLU) under Triton's CPU interpreter, against the torch expert loop of
layers/moe.py: decode- and prefill-sized batches, 32 experts top-4 (gpt-oss-20b's), with and
without the down bias (a TP rank other than 0 adds none), a limit the activations reach.

Runs in a subprocess (tests/triton_interpreter.py), fp32 and fp16 (the interpreter's tl.dot is
wrong for bf16 inputs).
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
sys.path.insert(0, str(REPO / "tests" / "unit"))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_gpt_oss_experts_under_interpreter():
    from triton_interpreter import run_under_interpreter

    run_under_interpreter(__file__)


def _run_checks() -> None:
    from batchrun.kernels.fused_moe import fused_moe, pick_config
    from batchrun.kernels.moe_gemv import moe_gemv
    from test_fused_moe_interpreter import make_routing

    from batchrun.layers.moe import ExpertExtras, moe_experts

    gen = torch.Generator().manual_seed(0)
    experts, top_k, hidden, inter = 32, 4, 64, 48
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.3).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.3).to(dtype)
        b13 = torch.randn(experts, 2 * inter, generator=gen).to(dtype)
        b2 = torch.randn(experts, hidden, generator=gen).to(dtype)
        for num_tokens in (1, 5, 70):
            x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
            weights, ids = make_routing(num_tokens, experts, top_k, gen)
            for down_bias in (b2, None):
                extras = ExpertExtras(b13, down_bias, 1.702, 1.5)
                ref = moe_experts(x.float(), w13.float(), w2.float(), weights, ids, "torch",
                                  ExpertExtras(b13.float(), None if down_bias is None else
                                               b2.float(), 1.702, 1.5))  # fmt: skip
                plain = moe_experts(x.float(), w13.float(), w2.float(), weights, ids, "torch")
                assert (ref - plain).abs().max() > 0.1  # the biases and the clamp matter
                gathered = pick_config(1000, experts, top_k, hidden, inter)._replace(gather=True)
                for name, out in (
                    ("fused_moe", fused_moe(x, w13, w2, weights, ids, extras=extras)),
                    ("gathered", fused_moe(x, w13, w2, weights, ids, gathered, extras)),
                    ("moe_gemv", moe_gemv(x, w13, w2, weights, ids, extras=extras)),
                ):
                    err = (out.float() - ref).abs().max() / ref.abs().max()
                    assert err <= tol, (name, dtype, num_tokens, err)
    print("ok")


if __name__ == "__main__":
    _run_checks()
