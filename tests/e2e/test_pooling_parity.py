"""Parity of the prefill-only tasks' models with sentence-transformers and transformers: tiny
random models of each family in their real layouts (tests/pooling_models.py), 16 texts of mixed
lengths in one packed batch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchrun.errors import ModelConfigError
from batchrun.pooling.model import (
    RERANK_INSTRUCTION,
    RERANK_PREFIX,
    RERANK_SUFFIX,
    load_pooling_model,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pooling_models import (  # noqa: E402
    TEXTS,
    make_decoder,
    make_encoder,
    make_sentence_transformer,
)

pytest.importorskip("sentence_transformers")


@pytest.mark.parametrize(
    "kind,family,pooling,normalize",
    [
        ("bert", "encoder", "mean", True),
        ("xlm-roberta", "encoder", "cls", True),
        ("modernbert", "encoder", "mean", True),
        ("qwen3", "decoder", "lasttoken", True),
        ("llama", "decoder", "mean", False),
        ("qwen2", "decoder", "lasttoken", True),
        ("mistral", "decoder", "lasttoken", True),
    ],
)
def test_embeddings_equal_sentence_transformers(tmp_path, kind, family, pooling, normalize):
    from sentence_transformers import SentenceTransformer

    hf = tmp_path / "hf"
    if family == "encoder":
        make_encoder(hf, kind)
    else:
        make_decoder(hf, kind, "base")
    st_dir = tmp_path / "st"
    make_sentence_transformer(hf, st_dir, pooling, normalize, max_seq_length=48)
    ref = SentenceTransformer(str(st_dir), device="cpu").encode(
        TEXTS, batch_size=16, convert_to_tensor=True
    )
    model = load_pooling_model(st_dir)
    rows = [model.tokenize(t) for t in TEXTS]
    assert model.max_len == 48 and sum(r.truncated for r in rows) == 3
    got = model.embed(rows)
    assert got.shape == ref.shape
    assert F.cosine_similarity(got, ref.float()).min() >= 0.99999


def test_matryoshka_dimensions_renormalize(tmp_path):
    make_encoder(tmp_path / "hf", "bert")
    make_sentence_transformer(tmp_path / "hf", tmp_path / "st", "mean", True, 48)
    model = load_pooling_model(tmp_path / "st")
    rows = [model.tokenize(t) for t in TEXTS[:4]]
    full = model.embed(rows, normalize=False)
    cut = model.embed(rows, dimensions=16)
    assert torch.allclose(cut, F.normalize(full[:, :16], dim=-1), atol=1e-6)
    assert torch.allclose(cut.norm(dim=-1), torch.ones(4))


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta", "modernbert"])
@pytest.mark.parametrize("num_labels", [1, 3])
def test_cross_encoder_scores_equal_transformers(tmp_path, kind, num_labels):
    from transformers import AutoTokenizer

    hf = make_encoder(tmp_path, kind, num_labels=num_labels)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    model = load_pooling_model(tmp_path)
    pairs = list(zip(TEXTS[:8], TEXTS[8:], strict=True))
    enc = tok([a for a, _ in pairs], [b for _, b in pairs], padding=True, truncation=True,
              max_length=model.max_len, return_tensors="pt")  # fmt: skip
    with torch.no_grad():
        logits = hf(**enc).logits
    got = model.classify_logits([model.tokenize(a, b) for a, b in pairs])
    assert torch.allclose(got, logits, atol=1e-5)
    scores = model.scores([model.tokenize(a, b) for a, b in pairs])
    expect = torch.sigmoid(logits[:, 0]) if num_labels == 1 else logits
    assert torch.allclose(scores, expect, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_sequence_classification_equals_transformers(tmp_path, kind):
    hf = make_decoder(tmp_path, kind, "classify", num_labels=2)
    model = load_pooling_model(tmp_path)
    rows = [model.tokenize(t) for t in TEXTS]
    got = model.classify_logits(rows)
    with torch.no_grad():
        want = torch.cat([hf(torch.tensor([r.input_ids])).logits for r in rows])
    assert torch.allclose(got, want, atol=1e-5)


def test_qwen3_reranker_equals_the_yes_no_formula(tmp_path):
    hf = make_decoder(tmp_path, "qwen3", "lm")
    # the reranker's card reads the "yes" / "no" tokens' logits: here two byte tokens stand in
    tok_json = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = tok_json["model"]["vocab"]
    vocab["yes"], vocab["no"] = vocab.pop("y"), vocab.pop("n")
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok_json))
    model = load_pooling_model(tmp_path)
    tok = model.tokenizer
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    query, docs = "what is a fox", TEXTS[:6]
    rows = [model.tokenize_yes_no(query, d, None) for d in docs]
    got = model.scores(rows)
    want = []
    for d in docs:
        body = f"<Instruct>: {RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: {d}"
        ids = tok.encode(RERANK_PREFIX + body + RERANK_SUFFIX, add_special_tokens=False)
        with torch.no_grad():
            last = hf(torch.tensor([ids])).logits[0, -1]
        want.append(torch.softmax(torch.stack([last[no], last[yes]]), 0)[1])
    assert torch.allclose(got, torch.stack(want), atol=1e-5)


def test_unsupported_module_and_missing_pooling_are_refused(tmp_path):
    make_encoder(tmp_path / "hf", "bert")
    model = load_pooling_model(tmp_path / "hf")
    with pytest.raises(ModelConfigError, match="pass --pooling"):
        model.embed([model.tokenize("x")])
    make_sentence_transformer(tmp_path / "hf", tmp_path / "max", "max", True, 48)
    with pytest.raises(ModelConfigError, match="pooling max is not supported"):
        load_pooling_model(tmp_path / "max")
    make_sentence_transformer(tmp_path / "hf", tmp_path / "st", "mean", True, 48)
    modules = json.loads((tmp_path / "st" / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense",
                       "type": "sentence_transformers.models.Dense"})  # fmt: skip
    (tmp_path / "st" / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelConfigError, match="module 'sentence_transformers.models.Dense'"):
        load_pooling_model(tmp_path / "st")


def test_a_folder_prompt_goes_before_the_text_as_sentence_transformers_puts_it(tmp_path):
    from sentence_transformers import SentenceTransformer

    make_decoder(tmp_path / "hf", "qwen3", "base")
    prompts = {"query": "Instruct: find the passage\nQuery:"}
    make_sentence_transformer(tmp_path / "hf", tmp_path / "st", "lasttoken", True, 64, prompts)
    ref = SentenceTransformer(str(tmp_path / "st"), device="cpu").encode(
        TEXTS, prompt_name="query", convert_to_tensor=True
    )
    model = load_pooling_model(tmp_path / "st")
    got = model.embed([model.tokenize(t, prompt=model.prompt("query")) for t in TEXTS])
    assert F.cosine_similarity(got, ref.float()).min() >= 0.99999
    with pytest.raises(ModelConfigError, match="not one of the model's prompts"):
        model.prompt("passage")
