"""The thinking budget through the engine and a whole job, on a tiny random llama with a
DeepSeek-R1-style tokenizer (its template opens <think> in the prompt): after N reasoning tokens
the engine writes the end-of-thinking tokens and the answer follows, the same with overlap
scheduling on and off; the job's records keep the reasoning (at most the N tokens the model
wrote) apart from the answer, and a thinking cut by max_tokens has no answer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chat_tokenizers import ids, make_tokenizer  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from tiny_models import COMMON  # noqa: E402

from batchrun.chat.markers import think_markers  # noqa: E402
from batchrun.cli import main  # noqa: E402
from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

BUDGET = 4
MAX_NEW = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    import transformers
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("r1")
    tok = make_tokenizer("deepseek_r1", path)
    eos = tok.convert_tokens_to_ids("<｜end▁of▁sentence｜>")
    cfg = transformers.LlamaConfig(**{**COMMON, "vocab_size": len(tok), "eos_token_id": eos})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def prompt(tok) -> list[int]:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    return ids(tok, tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def generate(model: Path, input_ids: list[int], overlap: bool = False, **params) -> list[int]:
    engine = Engine(
        EngineConfig(
            model=str(model), device="cpu", dtype="float32", kv_budget=2048, overlap=overlap
        )  # fmt: skip
    )
    p = SamplingParams(temperature=0.0, ignore_eos=True, **params)
    (result,) = list(engine.generate([GenerateRequest("r", input_ids, p)]))
    engine.check_integrity()
    return result.output_ids


def test_budget_ends_thinking_at_n_tokens_and_the_answer_follows(model, tok):
    markers = think_markers(tok)
    forced = list(markers.forced_ids)
    ids_in = prompt(tok)
    assert markers.opens_in(ids_in)
    base = generate(model, ids_in, max_new_tokens=MAX_NEW)
    assert markers.end_id not in base[:BUDGET]  # the model would think on
    for overlap in (False, True):
        out = generate(model, ids_in, overlap, max_new_tokens=MAX_NEW, max_thinking_tokens=BUDGET)
        assert out[:BUDGET] == base[:BUDGET]
        assert out[BUDGET : BUDGET + len(forced)] == forced
        assert len(out) == MAX_NEW
        # the answer: the model's own continuation after the forced end of thinking
        head = out[: BUDGET + len(forced)]
        rest = generate(model, ids_in + head, max_new_tokens=MAX_NEW - len(head))
        assert out[len(head) :] == rest


def submit(model: Path, data: Path, out: Path, *extra: str) -> list[dict]:
    args = ["submit", str(data), "--out", str(out), "--model", str(model), "--device", "cpu",
            "--temperature", "0", "--ignore-eos", "--kv-budget", "2048", "--quiet",
            "--in-process", "--token-ids", *extra]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, (result.output, result.exception)
    return [json.loads(line) for f in sorted(out.glob("results-*.jsonl")) for line in f.open()]


def test_job_records_keep_reasoning_apart(model, tok, tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "What is 2+2?"}]}) + "\n")
    forced = list(think_markers(tok).forced_ids)
    (rec,) = submit(model, data, tmp_path / "a", "--max-tokens", str(MAX_NEW),
                    "--max-thinking-tokens", str(BUDGET))  # fmt: skip
    out = rec["token_ids"]
    assert out[BUDGET : BUDGET + len(forced)] == forced
    assert rec["reasoning"] == tok.decode(out[:BUDGET], skip_special_tokens=True).strip()
    answer = tok.decode(out[BUDGET + len(forced) :], skip_special_tokens=True).strip()
    assert rec["text"] == answer and rec["finish_reason"] == "length"

    # thinking cut by max_tokens: the reasoning kept, no answer
    (cut,) = submit(model, data, tmp_path / "b", "--max-tokens", "3")
    assert cut["finish_reason"] == "length" and cut["text"] == ""
    assert cut["reasoning"] == tok.decode(cut["token_ids"], skip_special_tokens=True).strip()

    # the budget is part of the fingerprint: another budget does not resume the run
    args = ["submit", str(data), "--out", str(tmp_path / "a"), "--model", str(model),
            "--device", "cpu", "--temperature", "0", "--ignore-eos", "--quiet", "--in-process",
            "--token-ids", "--max-tokens", str(MAX_NEW), "--max-thinking-tokens", "2"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and "--max-thinking-tokens 4 -> 2" in result.output


def test_openai_text_completions_keep_the_whole_output_as_text(model, tok, tmp_path):
    # as the OpenAI-compatible servers write them: reasoning is parsed on the chat endpoint only
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    rows = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": messages, "max_tokens": 3}},
        {"custom_id": "text", "method": "POST", "url": "/v1/completions",
         "body": {"model": "m", "prompt": text, "max_tokens": 3}},
    ]  # fmt: skip
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = {r["custom_id"]: r["response"]["body"] for r in submit(model, data, tmp_path / "o")}
    message = lines["chat"]["choices"][0]["message"]
    assert message["content"] == "" and message["reasoning"] == message["reasoning_content"]
    choice = lines["text"]["choices"][0]
    assert "reasoning" not in choice and "reasoning_content" not in choice
    assert choice["text"].strip() == message["reasoning"]


def test_generate_dataset_keeps_reasoning_apart(model, tok):
    datasets = pytest.importorskip("datasets")
    from batchrun.job.datasets_api import generate_dataset

    forced = list(think_markers(tok).forced_ids)
    p = SamplingParams(
        max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, max_thinking_tokens=BUDGET
    )
    ds = datasets.Dataset.from_dict({"prompt": ["What is 2+2?"]})
    out = generate_dataset(
        ds, model=str(model), sampling=p, device="cpu", dtype="float32", kv_budget=2048
    )
    ids_out = generate(model, prompt(tok), max_new_tokens=MAX_NEW, max_thinking_tokens=BUDGET)
    assert out["reasoning"] == [tok.decode(ids_out[:BUDGET], skip_special_tokens=True).strip()]
    answer = tok.decode(ids_out[BUDGET + len(forced) :], skip_special_tokens=True).strip()
    assert out["completion"] == [answer]
