"""kernels/causal_conv1d.py under Triton's CPU interpreter against delta_rule.causal_conv (the
torch reference), request by request: packed batches of mixed lengths (shorter than the conv's
window, one token, across the token block), each from its own state in pool rows out of order,
the new states written in place and the other rows untouched; fp32 and bf16 states.

Skipped where triton is not installed. The kernel runs in a subprocess because TRITON_INTERPRET
must be set before triton is first imported.
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

# (lengths, channels, K): a decode batch, mixed prefill (1 < K-1, 2, across BLOCK_T), K 2
CASES = (((1, 1, 1), 40, 4), ((3, 1, 17, 2), 136, 4), ((5, 1), 24, 2))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_causal_conv1d_under_interpreter():
    from triton_interpreter import run_under_interpreter

    run_under_interpreter(__file__)


def check(lengths, channels, kernel, state_dtype) -> None:
    from batchrun.kernels.causal_conv1d import causal_conv1d

    from batchrun.models.blocks.delta_rule import causal_conv

    gen = torch.Generator().manual_seed(sum(lengths) + channels)
    num_rows = len(lengths) + 3
    states = torch.randn(num_rows, channels, kernel - 1, generator=gen).to(state_dtype)
    # inputs that the state dtype holds exactly (the interpreter casts to bf16 by truncation)
    x = torch.randn(sum(lengths), channels, generator=gen).to(state_dtype).float()
    weight = torch.randn(channels, 1, kernel, generator=gen)
    rows = torch.tensor([num_rows - 1 - 2 * b for b in range(len(lengths))][::-1])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    want_states = states.clone()
    want, start = [], 0
    for b, n in enumerate(lengths):
        out, new = causal_conv(x[start : start + n], weight, want_states[rows[b]].float())
        want_states[rows[b]] = new.to(state_dtype)
        want.append(out)
        start += n
    got = causal_conv1d(x, weight[:, 0], states, rows, cu, max(lengths))
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-5, atol=1e-5)
    assert torch.equal(states, want_states), (lengths, state_dtype)


def main() -> None:
    for lengths, channels, kernel in CASES:
        for state_dtype in (torch.float32, torch.bfloat16):
            check(lengths, channels, kernel, state_dtype)
    print("ok")


if __name__ == "__main__":
    main()
