"""The thinking budget on CUDA: with overlap scheduling (the host sees each token one step late),
CUDA graphs and several requests in the batch, the forced end-of-thinking tokens land after
exactly N reasoning tokens, and the tokens equal those of a run with overlap off and eager."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MAX_NEW = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    import transformers
    from chat_tokenizers import make_tokenizer
    from tiny_models import COMMON
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("r1-gpu")
    tok = make_tokenizer("deepseek_r1", path)
    eos = tok.convert_tokens_to_ids("<｜end▁of▁sentence｜>")
    cfg = transformers.LlamaConfig(**{**COMMON, "vocab_size": len(tok), "eos_token_id": eos})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval().save_pretrained(path)
    return path


def run(model: Path, budgets: list[int | None], kernels=None, **config) -> list[list[int]]:
    from chat_tokenizers import ids
    from transformers import AutoTokenizer

    from batchrun.config import EngineConfig
    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    tok = AutoTokenizer.from_pretrained(model)
    engine = Engine(
        EngineConfig(model=str(model), dtype="float32", kv_budget=4096, **config), kernels=kernels
    )
    requests = []
    for i, budget in enumerate(budgets):
        messages = [{"role": "user", "content": f"question {i}"}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        params = SamplingParams(
            max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, max_thinking_tokens=budget
        )
        requests.append(GenerateRequest(str(i), ids(tok, text), params))
    results = {r.rid: r.output_ids for r in engine.generate(requests)}
    engine.check_integrity()
    return [results[str(i)] for i in range(len(budgets))]


def test_budget_with_overlap_and_graphs_equals_eager_without_overlap(model):
    from transformers import AutoTokenizer

    from batchrun.chat.markers import think_markers
    from batchrun.config import KernelPlan

    markers = think_markers(AutoTokenizer.from_pretrained(model))
    forced = list(markers.forced_ids)
    budgets = [None, 1, 3, 8, 5, None, 2]
    fast = run(model, budgets)  # overlap and CUDA graphs: the defaults on CUDA
    slow = run(model, budgets, overlap=False, kernels=KernelPlan(cuda_graph_max_bs=0))
    assert fast == slow
    for out, budget in zip(fast, budgets):
        if budget is not None and markers.end_id not in out[:budget]:
            assert out[budget : budget + len(forced)] == forced, budget
