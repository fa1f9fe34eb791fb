"""The embedded SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32) against HF transformers.

Tolerance: teacher-forced logits within 1e-4 relative error (L2 over the whole [T, V] matrix) and
2e-3 max absolute error; both engines compute in fp32, so the difference is summation order only.
Greedy continuations are compared up to the first step where HF's top-1 margin is below 1e-3
(a 4-bit model has near-ties, where either token is a correct greedy choice).
"""

from __future__ import annotations

import pytest
import torch

from batchrun.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.params import GenerateRequest, SamplingParams

pytestmark = pytest.mark.slow  # CI's slow tier (BATCHRUN_SLOW_TESTS=1)

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain photosynthesis in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Give me a name for a pet turtle.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Write a Python function that adds two numbers.",
]
MARGIN = 1e-3
NEW = 40


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model=None, device="cpu", dtype="float32", kv_budget=16384))


@pytest.fixture(scope="module")
def hf(engine):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(engine.model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(engine):
    tok = engine.tokenizer
    return [
        tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
        for c in CHATS
    ]


def _ids(x):
    return list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x)


def test_teacher_forced_logits(engine, hf, prompts):
    for p in prompts:
        ids = _ids(p)
        ours = engine.score(ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        rel = ((ours - ref).norm() / ref.norm()).item()
        assert rel <= 1e-4, rel
        assert (ours - ref).abs().max().item() <= 2e-3


def test_greedy_continuations(engine, hf, prompts):
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0)
    reqs = [GenerateRequest(str(i), _ids(p), params) for i, p in enumerate(prompts)]
    ours = {r.rid: r.output_ids for r in engine.generate(reqs)}
    num_clear = 0
    for i, p in enumerate(prompts):
        ids = torch.tensor([_ids(p)])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=engine.tokenizer.pad_token_id,
        )
        ref = out.sequences[0, ids.shape[1] :].tolist()
        margins = [(s[0].topk(2).values[0] - s[0].topk(2).values[1]).item() for s in out.scores]
        clear = next((k for k, m in enumerate(margins) if m < MARGIN), len(ref))
        num_clear += clear == len(ref)
        assert ours[str(i)][: clear + 1] == ref[: clear + 1], f"prompt {i}: diverged by {clear}"
    assert num_clear >= len(prompts) // 2  # most prompts have a clear margin all the way
    engine.check_integrity()
