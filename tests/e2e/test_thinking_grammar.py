"""Structured output on thinking models applies to the answer, not the thinking: tiny random
llamas with thinking tokenizers, greedy, with overlap scheduling on and off. The reasoning is the
model's own (the tokens of a run without a grammar), the answer after </think> (the model's, or
the budget's forced one) matches the schema. Two models are biased by copying an lm_head row:
one closes its thinking itself, one opens it itself (a Qwen3-style template that leaves that
to the model), which the grammar's first row allows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("xgrammar")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chat_tokenizers import ids, make_tokenizer  # noqa: E402
from tiny_models import COMMON  # noqa: E402

from batchrun.chat.markers import think_markers  # noqa: E402
from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.params import GenerateRequest, GrammarSpec, SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
GRAMMAR = GrammarSpec("json_schema", json.dumps(SCHEMA))
BUDGET = 4
MAX_NEW = 48
USER = [{"role": "user", "content": "What is 2+2?"}]


def make_model(family: str, path: Path):
    import transformers
    from transformers import AutoModelForCausalLM

    tok = make_tokenizer(family, path)
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    cfg = transformers.LlamaConfig(**{**COMMON, "vocab_size": len(tok), "eos_token_id": eos})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(path)
    return tok, model


def bias(model, path: Path, token: int, like: int) -> None:
    """`token` takes the place of `like` where the model would write `like` (its lm_head row,
    scaled up)."""
    with torch.no_grad():
        model.lm_head.weight[token] = 1.5 * model.lm_head.weight[like]
    model.save_pretrained(path)


def prompt(tok, **kwargs) -> list[int]:
    text = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=False, **kwargs)
    return ids(tok, text)


def generate(path: Path, input_ids: list[int], overlap: bool = False, **params):
    engine = Engine(
        EngineConfig(
            model=str(path), device="cpu", dtype="float32", kv_budget=2048, overlap=overlap
        )  # fmt: skip
    )
    p = SamplingParams(temperature=0.0, **{"max_new_tokens": MAX_NEW, **params})
    (result,) = list(engine.generate([GenerateRequest("r", input_ids, p)]))
    engine.check_integrity()
    return result


def check_answer(tok, result, start: int) -> None:
    """The output from `start` on is a JSON answer that matches SCHEMA, then EOS."""
    out = result.output_ids
    assert result.finish_reason == "stop" and out[-1] == tok.eos_token_id
    answer = json.loads(tok.decode(out[start:-1]))
    assert set(answer) == {"ok"} and isinstance(answer["ok"], bool)


@pytest.fixture(scope="module")
def r1(tmp_path_factory):
    """A DeepSeek-R1-style model (its template opens <think> in the prompt)."""
    path = tmp_path_factory.mktemp("r1")
    tok, _ = make_model("deepseek_r1", path)
    return path, tok


@pytest.fixture(scope="module")
def r1_closing(tmp_path_factory):
    """The same, biased to close its thinking itself after three tokens."""
    path = tmp_path_factory.mktemp("r1_closing")
    tok, model = make_model("deepseek_r1", path)
    free = generate(path, prompt(tok), max_new_tokens=8, ignore_eos=True).output_ids
    bias(model, path, think_markers(tok).end_id, free[3])
    return path, tok


@pytest.fixture(scope="module")
def qwen3_opening(tmp_path_factory):
    """A Qwen3-style model (its template leaves the thinking to the model), biased to open it
    with its first token."""
    path = tmp_path_factory.mktemp("qwen3_opening")
    tok, model = make_model("qwen3", path)
    free = generate(path, prompt(tok), max_new_tokens=1, ignore_eos=True).output_ids
    bias(model, path, think_markers(tok).start_ids[0], free[0])
    return path, tok


@pytest.mark.parametrize("overlap", [False, True])
def test_budget_then_schema(r1, overlap):
    path, tok = r1
    forced = list(think_markers(tok).forced_ids)
    ids_in = prompt(tok)
    free = generate(path, ids_in, max_new_tokens=BUDGET, ignore_eos=True).output_ids
    assert tok.decode(free[:1]) != "{"  # the grammar alone would refuse the reasoning
    result = generate(path, ids_in, overlap, grammar=GRAMMAR, max_thinking_tokens=BUDGET)
    out = result.output_ids
    assert out[:BUDGET] == free[:BUDGET]
    assert out[BUDGET : BUDGET + len(forced)] == forced
    check_answer(tok, result, BUDGET + len(forced))


@pytest.mark.parametrize("overlap", [False, True])
def test_schema_starts_after_the_models_own_end_of_thinking(r1_closing, overlap):
    path, tok = r1_closing
    end = think_markers(tok).end_id
    ids_in = prompt(tok)
    free = generate(path, ids_in, max_new_tokens=8, ignore_eos=True).output_ids
    e = free.index(end)
    assert e >= 1 and tok.decode(free[:1]) != "{"
    result = generate(path, ids_in, overlap, grammar=GRAMMAR)
    assert result.output_ids[: e + 1] == free[: e + 1]
    check_answer(tok, result, e + 1)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_first_token_may_open_the_thinking(qwen3_opening, overlap):
    path, tok = qwen3_opening
    markers = think_markers(tok)
    head = 1 + BUDGET + len(markers.forced_ids)  # <think>, the reasoning, the forced end
    ids_in = prompt(tok)
    assert not markers.opens_in(ids_in)
    free = generate(path, ids_in, max_new_tokens=head, max_thinking_tokens=BUDGET)
    assert free.output_ids[0] == markers.start_ids[0]
    result = generate(path, ids_in, overlap, grammar=GRAMMAR, max_thinking_tokens=BUDGET)
    assert result.output_ids[:head] == free.output_ids[:head]
    check_answer(tok, result, head)

    # thinking off (the template writes an empty block): the grammar from the first token
    off = generate(path, prompt(tok, enable_thinking=False), overlap, grammar=GRAMMAR)
    check_answer(tok, off, 0)


def test_job_row_with_a_response_format_thinks_then_answers(r1, tmp_path):
    # the template opens <think> in the prompt: the record keeps the reasoning, the text is JSON
    from click.testing import CliRunner

    from batchrun.cli import main

    path, tok = r1
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"messages": USER, "response_format": fmt}) + "\n")
    out = tmp_path / "out"
    args = ["submit", str(data), "--out", str(out), "--model", str(path), "--device", "cpu",
            "--temperature", "0", "--kv-budget", "2048", "--quiet", "--in-process",
            "--max-tokens", str(MAX_NEW), "--max-thinking-tokens", str(BUDGET)]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, (result.output, result.exception)
    (rec,) = [json.loads(line) for f in out.glob("results-*.jsonl") for line in f.open()]
    assert rec["finish_reason"] == "stop" and rec["reasoning"]
    assert set(json.loads(rec["text"])) == {"ok"}
