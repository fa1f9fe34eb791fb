"""`batchrun submit --task embed` / `--task score` on CUDA in 16-bit: the job's vectors and scores
match SentenceTransformer.encode and CrossEncoder.predict in fp32 on the CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from batchrun.cli.main import main
from batchrun.pooling.vector_shard import read_vectors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pooling_models import TEXTS, make_encoder, make_sentence_transformer  # noqa: E402


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_embed_and_score_jobs_on_cuda(tmp_path, dtype):
    from sentence_transformers import CrossEncoder, SentenceTransformer

    make_encoder(tmp_path / "hf", "bert")
    make_sentence_transformer(tmp_path / "hf", tmp_path / "st", "mean", True, 48)
    make_encoder(tmp_path / "ce", "bert", num_labels=1)
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    common = ["--device", "cuda", "--dtype", dtype, "--in-process", "-q"]
    result = CliRunner().invoke(main, ["submit", str(data), "--model", str(tmp_path / "st"),
                                       "--out", str(tmp_path / "e"), *common])  # fmt: skip
    assert result.exit_code == 0, result.output
    table = read_vectors(sorted((tmp_path / "e").glob("vectors-*.parquet")),
                         order=[str(i) for i in range(len(TEXTS))])  # fmt: skip
    got = np.asarray(table.column("embedding").to_pylist())
    expect = SentenceTransformer(str(tmp_path / "st"), device="cpu").encode(TEXTS)
    cos = (got * expect).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(expect, axis=-1)
    assert cos.min() >= 0.999

    pairs = list(zip(TEXTS[:8], TEXTS[8:], strict=True))
    data.write_text("".join(json.dumps({"query": q, "document": d}) + "\n" for q, d in pairs))
    result = CliRunner().invoke(main, ["submit", str(data), "--model", str(tmp_path / "ce"),
                                       "--task", "score", "--out", str(tmp_path / "s"),
                                       *common])  # fmt: skip
    assert result.exit_code == 0, result.output
    records = [json.loads(x) for x in (tmp_path / "s" / "results-00000.jsonl").open()]
    scores = {int(r["id"]): r["score"] for r in records}
    expect = CrossEncoder(str(tmp_path / "ce"), device="cpu").predict(pairs)
    assert np.allclose([scores[i] for i in range(8)], expect, atol=2e-2)
