"""vLLM's score and rerank bodies in OpenAI Batch rows: the pairs they read (1:1, 1:N, N:N; a
rerank's top_n and return_documents), and a job over a cross-encoder that answers each in vLLM's
response shape with CrossEncoder.predict's scores; a bad body is the row's error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from batchrun.cli.main import main
from batchrun.pooling.openai_scores import read_score_body, score_response

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pooling_models import TEXTS, make_encoder  # noqa: E402


def test_score_bodies_pair_1_to_1_1_to_n_and_n_to_n():
    assert read_score_body("/score", {"text_1": "q", "text_2": "d"}).pairs == (("q", "d"),)
    one_n = read_score_body("/v1/score", {"text_1": ["q"], "text_2": ["a", "b"]})
    assert one_n.pairs == (("q", "a"), ("q", "b")) and not one_n.rerank
    n_n = read_score_body("/v1/score", {"text_1": ["x", "y"], "text_2": ["a", "b"]})
    assert n_n.pairs == (("x", "a"), ("y", "b"))
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        read_score_body("/v1/score", {"text_1": ["x", "y"], "text_2": ["a", "b", "c"]})
    with pytest.raises(ValueError, match="body.text_2 must be a string"):
        read_score_body("/v1/score", {"text_1": "x"})


def test_rerank_response_orders_by_score_keeps_top_n_and_documents_as_asked():
    body = read_score_body("/v1/rerank", {"query": "q", "documents": ["a", "b", "c"], "top_n": 2})
    response = score_response(body, [0.1, 0.9, 0.5], "m", 12)
    assert [r["index"] for r in response["results"]] == [1, 2]
    assert response["results"][0] == {"index": 1, "document": {"text": "b"},
                                      "relevance_score": 0.9}  # fmt: skip
    assert response["usage"] == {"prompt_tokens": 12, "total_tokens": 12}
    body = read_score_body("/rerank", {"query": "q", "documents": ["a"], "return_documents": False})
    assert score_response(body, [0.3], "m", 3)["results"] == [{"index": 0, "relevance_score": 0.3}]
    with pytest.raises(ValueError, match="top_n"):
        read_score_body("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1})


def test_a_job_answers_score_and_rerank_rows_in_vllms_shapes(tmp_path):
    from sentence_transformers import CrossEncoder

    make_encoder(tmp_path / "ce", "bert", num_labels=1)
    query, docs = TEXTS[0], TEXTS[8:12]

    def row(cid, url, body):
        return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "m", **body}}

    rows = [
        row("s", "/v1/score", {"text_1": query, "text_2": docs}),
        row("r", "/rerank", {"query": query, "documents": docs, "top_n": 3}),
        row("bad", "/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]}),
        row("emb", "/v1/embeddings", {"input": "x"}),
    ]
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "o"
    result = CliRunner().invoke(main, ["submit", str(data), "--model", str(tmp_path / "ce"),
                                       "--task", "rerank", "--in-process", "-q", "--out",
                                       str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output + repr(result.exception)
    got = {r["custom_id"]: r for r in map(json.loads, (out / "results-00000.jsonl").open())}
    expect = CrossEncoder(str(tmp_path / "ce"), device="cpu").predict([(query, d) for d in docs])
    score = got["s"]["response"]["body"]
    assert score["object"] == "list" and score["model"] == "m" and score["id"].startswith("score-")
    assert [d["index"] for d in score["data"]] == [0, 1, 2, 3]
    assert np.allclose([d["score"] for d in score["data"]], expect, atol=1e-5)
    assert score["usage"]["completion_tokens"] == 0 and score["usage"]["prompt_tokens"] > 0
    rerank = got["r"]["response"]["body"]
    best = list(np.argsort(-expect)[:3])
    assert [r["index"] for r in rerank["results"]] == best
    assert [r["document"]["text"] for r in rerank["results"]] == [docs[i] for i in best]
    assert np.allclose([r["relevance_score"] for r in rerank["results"]], expect[best], atol=1e-5)
    errors = {e["custom_id"]: e for e in map(json.loads, (out / "errors-00000.jsonl").open())}
    assert "1:1, 1:N or N:N" in json.dumps(errors["bad"])
    assert "--task embed" in json.dumps(errors["emb"])
