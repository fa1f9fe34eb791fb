"""PoolingEngine: steps packed by a token budget give what one batch gives, every sequence once;
the task options are checked against the model at start-up; a causal step computes the prefix its
sequences share once and gives the unshared values."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from batchrun.errors import ModelConfigError
from batchrun.pooling.engine import PoolingEngine, PoolRequest, TaskOptions
from batchrun.pooling.model import load_pooling_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pooling_models import (  # noqa: E402
    TEXTS,
    make_decoder,
    make_encoder,
    make_sentence_transformer,
)


@pytest.fixture(scope="module")
def st_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool")
    make_encoder(root / "hf", "bert")
    make_sentence_transformer(root / "hf", root / "st", "mean", True, 48)
    return root


def test_budgeted_steps_equal_one_batch(st_dir):
    model = load_pooling_model(st_dir / "st")
    rows = [model.tokenize(t) for t in TEXTS]
    whole = model.embed(rows)
    engine = PoolingEngine(model, TaskOptions("embed"), max_step_tokens=40)
    engine.add([PoolRequest(i, r) for i, r in enumerate(rows)])
    results, steps = [], 0
    while engine.has_work:
        results += engine.step()
        steps += 1
    assert steps > 4 and sorted(r.rid for r in results) == list(range(len(TEXTS)))
    got = torch.stack([r.value for r in sorted(results, key=lambda r: r.rid)])
    assert torch.allclose(got, whole, atol=1e-5)


def test_options_are_checked_against_the_model(st_dir):
    model = load_pooling_model(st_dir / "st")
    with pytest.raises(ModelConfigError, match="give 1 to 64"):
        TaskOptions("embed", dimensions=65).validate(model)
    with pytest.raises(ModelConfigError, match="needs a classification head"):
        TaskOptions("rerank").validate(model)
    with pytest.raises(ModelConfigError, match="classify needs a sequence-classification head"):
        TaskOptions("classify").validate(model)
    with pytest.raises(ModelConfigError, match="pass --pooling"):
        TaskOptions("embed").validate(load_pooling_model(st_dir / "hf"))
    TaskOptions("embed", pooling="cls").validate(load_pooling_model(st_dir / "hf"))
    with pytest.raises(ValueError, match="an empty text"):
        model.tokenize("")


def _run(engine: PoolingEngine, requests: list[PoolRequest]) -> list:
    engine.add(requests)
    results = []
    while engine.has_work:
        results += engine.step()
    return sorted(results, key=lambda r: r.rid)


def _yes_no_reranker(path: Path):
    make_decoder(path, "qwen3", "lm")
    tok_json = json.loads((path / "tokenizer.json").read_text())
    vocab = tok_json["model"]["vocab"]
    vocab["yes"], vocab["no"] = vocab.pop("y"), vocab.pop("n")
    (path / "tokenizer.json").write_text(json.dumps(tok_json))
    return load_pooling_model(path)


def test_a_rerank_rows_query_is_computed_once(tmp_path):
    model = _yes_no_reranker(tmp_path)
    queries = ["what is a fox", "capital of France", "unicode"]
    rows = [model.tokenize_yes_no(q, d, None) for q in queries for d in TEXTS[:5]]
    want = model.scores(rows)  # each sequence alone
    engine = PoolingEngine(model, TaskOptions("rerank"), max_step_tokens=2000)
    assert engine.share
    results = _run(engine, [PoolRequest(i, r) for i, r in enumerate(rows)])
    got = torch.stack([r.value for r in results])
    assert torch.allclose(got, want, atol=1e-5)
    # every sequence after the first reads the prompt's system line and the instruction from
    # the one before it, a row's later documents their query too
    shared = [r.num_shared for r in results]
    assert all(n > 150 for n in shared[1:])
    assert sum(shared) > 0.5 * sum(r.num_tokens for r in results)


@pytest.mark.parametrize("kind,task", [("gemma3", "classify"), ("qwen2", "embed")])
def test_a_shared_instruction_prefix_gives_the_unshared_values(tmp_path, kind, task):
    make_decoder(tmp_path, kind, "classify" if task == "classify" else "base", num_labels=3)
    model = load_pooling_model(tmp_path)
    instruction = "Instruct: retrieve passages that answer the question\nQuery: "
    rows = [model.tokenize(t, prompt=instruction) for t in TEXTS]
    options = TaskOptions(task, "last", True) if task == "embed" else TaskOptions(task)
    if task == "embed":
        want = model.embed(rows, "last", True)
    else:
        want = model.classify_logits(rows)
    engine = PoolingEngine(model, options, max_step_tokens=300)
    results = _run(engine, [PoolRequest(i, r) for i, r in enumerate(rows)])
    got = torch.stack([r.value for r in results])
    assert torch.allclose(got, want, atol=1e-5)
    assert sum(r.num_shared > 0 for r in results) >= len(TEXTS) - 4  # one per step does not
