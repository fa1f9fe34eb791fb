"""A rerank job on a decoder yes/no reranker (Qwen3-Reranker) computes each row's instruction and
query once for its documents: the scores equal each (query, document) alone, and the summary and
the manifest count the shared-prefix tokens as cached prompt tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from click.testing import CliRunner

from batchrun.cli.main import main
from batchrun.pooling.model import load_pooling_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pooling_models import TEXTS, make_decoder  # noqa: E402


def test_rerank_job_shares_the_query_and_reports_the_tokens_saved(tmp_path):
    model_dir = tmp_path / "reranker"
    make_decoder(model_dir, "qwen3", "lm")
    tok_json = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tok_json["model"]["vocab"]
    vocab["yes"], vocab["no"] = vocab.pop("y"), vocab.pop("n")
    (model_dir / "tokenizer.json").write_text(json.dumps(tok_json))
    queries = ["what is a fox", "capital of France", "b c d"]
    rows = [{"id": f"q{i}", "query": q, "documents": TEXTS[i : i + 4]}
            for i, q in enumerate(queries)]  # fmt: skip
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["submit", str(data), "--model", str(model_dir), "--task",
                                       "rerank", "--in-process", "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output + repr(result.exception)
    model = load_pooling_model(model_dir)
    records = {r["id"]: r for r in map(json.loads, (out / "results-00000.jsonl").open())}
    for row in rows:
        pairs = [model.tokenize_yes_no(row["query"], d, None) for d in row["documents"]]
        want = model.scores(pairs)  # each document alone
        assert torch.allclose(torch.tensor(records[row["id"]]["scores"]), want, atol=1e-5)
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert counts["cached_tokens"] > 0.5 * counts["prompt_tokens"]
    assert "shared prefixes" in result.output
