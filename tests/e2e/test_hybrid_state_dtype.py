"""The hybrid models' state dtype (EngineConfig.linear_state_dtype), measured against transformers
on the CPU: an fp32 model whose recurrent states are kept in bf16 between steps, on the 8 prompts
and 32 greedy tokens of tests/e2e/test_parity_hybrid.py (chunked prefill of 48 tokens, so
chunks and decode steps read the stored state). The measure: the rows whose 32 tokens equal
transformers' (fp32 states: all of them, test_parity_hybrid.py), and the chosen tokens' logprobs
against transformers' up to each row's first different token.

The default follows the rule of docs/hybrid.md ("The state's dtype"): bf16 only where its tokens
hold on every row; the test fails when the measurement and the default disagree. Run with -s to
see the measurement (docs/hybrid.md quotes it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybrid_models import make_hybrid_model  # noqa: E402
from tiny_models import hf_greedy  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

NEW_TOKENS = 32
LENGTHS = (2, 3, 9, 26, 38, 64, 65, 100)  # test_parity_hybrid.py's
_G = torch.Generator().manual_seed(2)
PROMPTS = [torch.randint(3, 256, (n,), generator=_G).tolist() for n in LENGTHS]
# the chosen tokens' logprobs of a bf16-state run stay this close to transformers' while its
# tokens agree (a bound on the state's rounding, not a parity tolerance)
BF16_LOGPROB_BOUND = 1.0


def measure(kind: str, path: Path, state_dtype: str, dtype: str = "float32"):
    """(rows equal to transformers, each row's first different token (32: none), the largest
    |logprob - transformers'| before it) of a `dtype` model with `state_dtype` states."""
    hf = make_hybrid_model(kind, path)
    config = EngineConfig(model=str(path), device="cpu", dtype=dtype, kv_budget=8192,
                          chunked_prefill_size=48, linear_state_dtype=state_dtype)  # fmt: skip
    engine = Engine(config)
    pool = engine.runner.states
    assert pool.ssm.dtype == pool.conv.dtype == getattr(torch, state_dtype)
    params = SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True
    )
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(PROMPTS)]
    results = {r.rid: r for r in engine.generate(reqs)}
    engine.check_integrity()
    firsts, worst = [], 0.0
    for i, prompt in enumerate(PROMPTS):
        want = hf_greedy(hf, prompt, NEW_TOKENS)
        got = results[str(i)]
        first = next(
            (j for j, (a, b) in enumerate(zip(got.output_ids, want)) if a != b), NEW_TOKENS
        )
        firsts.append(first)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + want])).logits[0].float().log_softmax(-1)
        for j in range(first):
            worst = max(worst, abs(got.logprobs[j] - ref[len(prompt) - 1 + j, want[j]].item()))
    return sum(f == NEW_TOKENS for f in firsts), firsts, worst


@pytest.mark.parametrize("kind", ["qwen3_5_text", "qwen3_next"])
def test_bf16_states_against_transformers_decide_the_default(kind, tmp_path):
    equal, firsts, worst = measure(kind, tmp_path, "bfloat16")
    print(f"{kind}, bf16 states: {equal}/{len(PROMPTS)} rows equal to transformers; first "
          f"different token {firsts}; max |logprob delta| before it {worst:.2e}")  # fmt: skip
    assert worst < BF16_LOGPROB_BOUND
    default = EngineConfig().linear_state_dtype
    assert default == ("bfloat16" if equal == len(PROMPTS) else "float32"), (equal, firsts)


@pytest.mark.slow  # CI's slow tier (BATCHRUN_SLOW_TESTS=1): six engine runs
@pytest.mark.parametrize("kind", ["qwen3_5_text", "qwen3_next"])
def test_a_bf16_model_loses_more_tokens_than_bf16_states(kind, tmp_path):
    """For scale (docs/hybrid.md): the model's own bf16 rounding, with fp32 states, changes
    tokens on at least as many rows as bf16 states on the fp32 model."""
    states, _, _ = measure(kind, tmp_path / "states", "bfloat16")
    model, firsts, _ = measure(kind, tmp_path / "model", "float32", dtype="bfloat16")
    both, both_firsts, _ = measure(kind, tmp_path / "both", "bfloat16", dtype="bfloat16")
    print(f"{kind}, bf16 model: fp32 states {model}/{len(PROMPTS)} rows equal ({firsts}), bf16 "
          f"states {both}/{len(PROMPTS)} ({both_firsts})")  # fmt: skip
    assert model <= states


def test_bf16_states_take_half_the_bytes(tmp_path):
    make_hybrid_model("qwen3_5_text", tmp_path)
    engines = {
        dtype: Engine(
            EngineConfig(
                model=str(tmp_path),
                device="cpu",
                dtype="float32",
                kv_budget=1024,
                linear_state_dtype=dtype,
            )
        )  # fmt: skip
        for dtype in ("float32", "bfloat16")
    }
    pools = {dtype: e.runner.states for dtype, e in engines.items()}
    nbytes = {d: p.conv.nbytes + p.ssm.nbytes for d, p in pools.items()}
    assert nbytes["bfloat16"] * 2 == nbytes["float32"]
    rows = engines["float32"].config.max_running + 1
    assert nbytes["bfloat16"] == pools["bfloat16"].bytes_per_row("bfloat16") * rows
