"""Structured output on a thinking model on CUDA: with overlap scheduling, the host gate (the
bitmask filled on the fill thread while the device runs) and CUDA graphs, several grammar
requests with and without thinking budgets, beside free ones, give the tokens of a run with
overlap off and eager; each answer after the thinking matches the schema."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
pytest.importorskip("xgrammar")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
MAX_NEW = 48


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    import transformers
    from chat_tokenizers import make_tokenizer
    from tiny_models import COMMON
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("r1-grammar-gpu")
    tok = make_tokenizer("deepseek_r1", path)
    eos = tok.convert_tokens_to_ids("<｜end▁of▁sentence｜>")
    cfg = transformers.LlamaConfig(**{**COMMON, "vocab_size": len(tok), "eos_token_id": eos})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval().save_pretrained(path)
    return path


def run(model: Path, rows: list[tuple[bool, int | None]], kernels=None, **config):
    from chat_tokenizers import ids
    from transformers import AutoTokenizer

    from batchrun.config import EngineConfig
    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, GrammarSpec, SamplingParams

    tok = AutoTokenizer.from_pretrained(model)
    engine = Engine(
        EngineConfig(model=str(model), dtype="float32", kv_budget=4096, **config), kernels=kernels
    )
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
    requests = []
    for i, (constrained, budget) in enumerate(rows):
        messages = [{"role": "user", "content": f"question {i}"}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        params = SamplingParams(
            max_new_tokens=MAX_NEW,
            temperature=0.0,
            max_thinking_tokens=budget,
            grammar=grammar if constrained else None,
        )
        requests.append(GenerateRequest(str(i), ids(tok, text), params))
    results = {r.rid: r for r in engine.generate(requests)}
    engine.check_integrity()
    return tok, [results[str(i)] for i in range(len(rows))]


def test_grammar_after_thinking_with_overlap_gate_and_graphs_equals_eager(model):
    from batchrun.chat.markers import think_markers
    from batchrun.config import KernelPlan

    rows = [(True, 1), (False, None), (True, 3), (True, 8), (False, 2), (True, 5), (True, 2)]
    tok, fast = run(model, rows)  # overlap, the host gate and CUDA graphs: the CUDA defaults
    _, slow = run(model, rows, overlap=False, kernels=KernelPlan(cuda_graph_max_bs=0))
    assert [r.output_ids for r in fast] == [r.output_ids for r in slow]
    markers = think_markers(tok)
    end, forced = markers.end_id, list(markers.forced_ids)
    for result, (constrained, budget) in zip(fast, rows):
        out = result.output_ids
        if not constrained or end not in out:
            continue
        start = out.index(end) + 1  # the model's own end of thinking
        if end not in out[:budget] and out[budget : budget + len(forced)] == forced:
            start = budget + len(forced)  # the budget's: "\n\n" follows </think>
        assert result.finish_reason == "stop", result
        answer = json.loads(tok.decode(out[start:-1]))
        assert set(answer) == {"ok"} and isinstance(answer["ok"], bool)
