"""PoolingEngine: steps packed by a token budget give what one batch gives, every sequence once;
the task options are checked against the model at start-up; tokenization in worker processes
equals the in-process tokenizer's, and a row's bad text comes back as its error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from batchrun.errors import ModelConfigError
from batchrun.pooling.engine import PoolingEngine, PoolRequest, TaskOptions
from batchrun.pooling.model import load_pooling_model
from batchrun.pooling.tokenize import ParallelTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pooling_models import TEXTS, make_encoder, make_sentence_transformer  # noqa: E402


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


def test_worker_processes_tokenize_as_the_model_does(st_dir):
    model = load_pooling_model(st_dir / "st")
    items = [(t, None, None) for t in TEXTS] + [("", None, None)]
    with ParallelTokenizer(st_dir / "st", model.max_len, model.kind, 2, chunk=5) as tok:
        got = list(tok.map(items))
    assert got[:-1] == [model.tokenize(t) for t in TEXTS]
    assert got[-1] == "an empty text: nothing to embed or score"
