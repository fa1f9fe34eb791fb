"""`batchrun submit --task embed|rerank|score|classify`: the job runs a pooling model end to end.
An embed job's Parquet vectors equal SentenceTransformer.encode; rerank and score jobs give
CrossEncoder.predict's scores; bad rows go to the errors shard with their row numbers; a job
killed with SIGKILL and resumed gives every id once and the clean run's vectors; export gives
one Parquet file in input order."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchrun.cli.main import main
from batchrun.pooling.vector_shard import read_vectors

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pooling_models import TEXTS, make_encoder, make_sentence_transformer  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pooljob")
    make_encoder(root / "hf", "bert")
    make_sentence_transformer(root / "hf", root / "st", "mean", True, 48)
    make_encoder(root / "ce", "bert", num_labels=1)
    return root


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def submit(*args: str) -> None:
    result = CliRunner().invoke(main, ["submit", *args, "--in-process", "-q"])
    assert result.exit_code == 0, result.output + repr(result.exception)


def vectors(out: Path) -> dict[str, np.ndarray]:
    table = read_vectors(sorted(out.glob("vectors-*.parquet")))
    ids = table.column("id").to_pylist()
    return dict(zip(ids, np.asarray(table.column("embedding").to_pylist()), strict=True))


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_embed_job_equals_sentence_transformers(models, tmp_path):
    from sentence_transformers import SentenceTransformer

    data = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "text": t} for i, t in
                                               enumerate(TEXTS)])  # fmt: skip
    out = tmp_path / "out"
    submit(str(data), "--model", str(models / "st"), "--out", str(out))
    got = vectors(out)
    assert sorted(got) == sorted(f"r{i}" for i in range(len(TEXTS)))
    expect = SentenceTransformer(str(models / "st"), device="cpu").encode(TEXTS)
    mine = np.stack([got[f"r{i}"] for i in range(len(TEXTS))])
    assert cosine(mine, expect).min() >= 0.99999
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["fingerprint"]["task"]["task"] == "embed"

    # the task's options are in the resume fingerprint: another --dimensions is another run
    result = CliRunner().invoke(main, ["submit", str(data), "--model", str(models / "st"),
                                       "--out", str(out), "--dimensions", "8"])  # fmt: skip
    assert result.exit_code != 0 and "--task and its options" in result.output

    # a longer text is cut and counted; with --no-truncate it is a row error
    long_out = tmp_path / "long"
    result = CliRunner().invoke(main, ["submit", str(data), "--model", str(models / "st"),
                                       "--out", str(long_out), "--in-process", "-q",
                                       "--no-truncate"])  # fmt: skip
    assert result.exit_code == 0, result.output
    errors = [json.loads(x) for x in (long_out / "errors-00000.jsonl").open()]
    assert errors and all(e["error"]["type"] == "context_length_exceeded" for e in errors)
    assert len(errors) + len(vectors(long_out)) == len(TEXTS)


def test_score_and_rerank_jobs_equal_cross_encoder(models, tmp_path):
    from sentence_transformers import CrossEncoder

    pairs = list(zip(TEXTS[:8], TEXTS[8:], strict=True))
    expect = CrossEncoder(str(models / "ce"), device="cpu").predict(pairs)
    score_in = write_jsonl(tmp_path / "s.jsonl", [{"query": q, "document": d} for q, d in pairs])
    submit(str(score_in), "--model", str(models / "ce"), "--task", "score",
           "--out", str(tmp_path / "s"))  # fmt: skip
    records = [json.loads(x) for x in (tmp_path / "s" / "results-00000.jsonl").open()]
    got = {int(r["id"]): r["score"] for r in records}
    assert np.allclose([got[i] for i in range(8)], expect, atol=1e-5)

    query = TEXTS[0]
    docs = TEXTS[8:]
    rerank_in = write_jsonl(tmp_path / "r.jsonl", [{"id": "q", "query": query, "documents": docs}])
    submit(str(rerank_in), "--model", str(models / "ce"), "--task", "rerank",
           "--out", str(tmp_path / "r"))  # fmt: skip
    (record,) = [json.loads(x) for x in (tmp_path / "r" / "results-00000.jsonl").open()]
    expect = CrossEncoder(str(models / "ce"), device="cpu").predict([(query, d) for d in docs])
    assert np.allclose(record["scores"], expect, atol=1e-5)


def test_classify_job_gives_probs_and_labels(tmp_path):
    import torch
    from transformers import AutoTokenizer

    hf = make_encoder(tmp_path / "m", "bert", num_labels=3)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    texts = [t for t in TEXTS if len(t) < 100][:6]  # within the model's positions
    data = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    submit(str(data), "--model", str(tmp_path / "m"), "--out", str(tmp_path / "o"))  # default
    records = {
        int(r["id"]): r for r in map(json.loads, (tmp_path / "o" / "results-00000.jsonl").open())
    }
    with torch.no_grad():
        enc = tok(texts, padding=True, return_tensors="pt")
        probs = hf(**enc).logits.softmax(-1)
    got = torch.tensor([records[i]["probs"] for i in range(6)])
    assert torch.allclose(got, probs, atol=1e-5)
    labels = hf.config.id2label
    assert [records[i]["label"] for i in range(6)] == [labels[int(p.argmax())] for p in probs]


def test_bad_rows_go_to_the_errors_shard(models, tmp_path):
    rows = [{"query": "q", "document": "d"}, {"query": "q"}, {"query": "", "document": "d"},
            {"text_1": "a", "text_2": "b"}]  # fmt: skip
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    submit(
        str(data), "--model", str(models / "ce"), "--task", "score", "--out", str(tmp_path / "o")
    )
    errors = [json.loads(x) for x in (tmp_path / "o" / "errors-00000.jsonl").open()]
    assert sorted(e["id"] for e in errors) == ["1", "2"]
    assert any("document" in json.dumps(e) for e in errors)
    ok = [json.loads(x) for x in (tmp_path / "o" / "results-00000.jsonl").open()]
    assert sorted(r["id"] for r in ok) == ["0", "3"]

    embed = write_jsonl(tmp_path / "e.jsonl", [{"text": "fine"}, {"text": ""}, {"other": 1}])
    submit(str(embed), "--model", str(models / "st"), "--out", str(tmp_path / "e"))
    errors = [json.loads(x) for x in (tmp_path / "e" / "errors-00000.jsonl").open()]
    assert sorted(e["id"] for e in errors) == ["1", "2"]
    assert list(vectors(tmp_path / "e")) == ["0"]


def test_openai_embeddings_rows_get_the_embeddings_response(models, tmp_path):
    import base64

    from sentence_transformers import SentenceTransformer

    def row(cid, body):
        return {"custom_id": cid, "method": "POST", "url": "/v1/embeddings", "body": body}

    rows = [
        row("a", {"model": "m", "input": TEXTS[0]}),
        row("b", {"model": "m", "input": TEXTS[1:4], "encoding_format": "base64"}),
        row("c", {"model": "m", "input": TEXTS[4], "dimensions": 16}),
        row("d", {"model": "m", "input": [1, 2]}),
    ]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    submit(str(data), "--model", str(models / "st"), "--out", str(tmp_path / "o"))
    out = {
        r["custom_id"]: r for r in map(json.loads, (tmp_path / "o" / "results-00000.jsonl").open())
    }
    st = SentenceTransformer(str(models / "st"), device="cpu")
    expect = st.encode(TEXTS[:5])
    a = out["a"]["response"]["body"]
    assert a["object"] == "list" and a["model"] == "m" and a["usage"]["prompt_tokens"] > 0
    assert cosine(np.array(a["data"][0]["embedding"]), expect[0]) >= 0.99999
    b = out["b"]["response"]["body"]["data"]
    got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in b])
    assert [d["index"] for d in b] == [0, 1, 2] and cosine(got, expect[1:4]).min() >= 0.99999
    c = np.array(out["c"]["response"]["body"]["data"][0]["embedding"])
    cut = expect[4][:16] / np.linalg.norm(expect[4][:16])
    assert c.shape == (16,) and np.allclose(c, cut, atol=1e-5)
    (error,) = [json.loads(x) for x in (tmp_path / "o" / "errors-00000.jsonl").open()]
    assert error["custom_id"] == "d" and "token-id" in json.dumps(error)
    assert not list((tmp_path / "o").glob("vectors-*"))


def test_a_deleted_vector_file_runs_its_rows_again(models, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    out = tmp_path / "o"
    submit(str(data), "--model", str(models / "st"), "--out", str(out))
    before = vectors(out)
    (out / "vectors-00000.parquet").unlink()
    submit(str(data), "--model", str(models / "st"), "--out", str(out))
    after = vectors(out)
    assert sorted(after) == sorted(before) and len(after) == len(TEXTS)


def test_sharded_embed_job_merges_and_exports_in_input_order(models, tmp_path):
    n = 40
    data = write_jsonl(tmp_path / "in.jsonl", [{"text": f"text {i} " * (i % 5 + 1)}
                                               for i in range(n)])  # fmt: skip
    out = tmp_path / "o"
    for i in range(2):
        submit(str(data), "--model", str(models / "st"), "--out", str(out),
               "--num-shards", "2", "--shard-index", str(i))  # fmt: skip
    assert all(list((out / f"shard-{i}").glob("vectors-*.parquet")) for i in range(2))
    result = CliRunner().invoke(main, ["merge", str(out)])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["export", str(out)])
    assert result.exit_code == 0, result.output
    table = pq.read_table(out / "export.parquet")
    assert table.column("id").to_pylist() == [str(i) for i in range(n)]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "generate", "--dimensions", "8"], "--dimensions"),
        (["--task", "score", "--pooling", "mean"], "--task embed only"),
        (["--task", "embed", "--raw-scores"], "--raw-scores"),
        (["--task", "embed", "--dp", "2"], "one device"),
    ],
)
def test_a_bad_combination_exits_2_naming_what_is_supported(models, tmp_path, args, message):
    data = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    result = CliRunner().invoke(main, ["submit", str(data), "--model", str(models / "st"),
                                       "--out", str(tmp_path / "o"), *args])  # fmt: skip
    assert result.exit_code == 2 and message in result.output


@pytest.mark.slow
def test_killed_embed_job_resumes_every_id_once_and_exports_in_input_order(models, tmp_path):
    n = 2000
    texts = [f"row {i}: " + "word " * (i % 37) for i in range(n)]
    data = write_jsonl(tmp_path / "in.jsonl", [{"id": f"id{i}", "text": t} for i, t in
                                               enumerate(texts)])  # fmt: skip
    args = ["submit", str(data), "--model", str(models / "st"), "--in-process", "-q",
            "--commit-every", "100"]  # fmt: skip
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    submit(*args[1:-2], "--out", str(clean), "--commit-every", "100")
    # the killed run has two tokenizer worker processes, which leave with it
    cmd = [sys.executable, "-P", "-m", "batchrun.cli", *args, "--out", str(killed),
           "--tokenizer-workers", "2"]  # fmt: skip
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 120
    while not list(killed.glob("vectors-00002.parquet")) and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, f"tokenizer workers outlived the killed job: {alive}"
    manifest = json.loads((killed / "manifest.json").read_text())
    assert manifest["status"] == "running"  # killed mid-run
    subprocess.run(cmd, check=True)
    got, expect = vectors(killed), vectors(clean)
    assert len(got) == n and sorted(got) == sorted(expect)
    ids = [f"id{i}" for i in range(n)]
    assert cosine(np.stack([got[i] for i in ids]), np.stack([expect[i] for i in ids])).min() >= (
        0.999999
    )
    result = CliRunner().invoke(main, ["export", str(killed)])
    assert result.exit_code == 0, result.output
    table = pq.read_table(killed / "export.parquet")
    assert table.column("id").to_pylist() == ids


def test_tokenizer_workers_give_the_in_process_rows_and_say_what_bounds_the_run(models, tmp_path):
    """With --tokenizer-workers 2 the vectors and the row errors equal the in-process run's,
    every id once, and the summary compares the two rates (tests/e2e/test_pooling_rows.py: the
    workers' rows equal the in-process ones)."""
    rows = [{"id": f"id{i}", "text": TEXTS[i % 16] * (1 + i % 3)} for i in range(600)]
    rows[17] = {"id": "bad", "text": ""}
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    outs = {}
    for workers in ("0", "2"):
        out = tmp_path / f"w{workers}"
        result = CliRunner().invoke(main, [
            "submit", str(data), "--model", str(models / "st"), "--in-process", "--out", str(out),
            "--tokenizer-workers", workers,
        ])  # fmt: skip
        assert result.exit_code == 0, result.output + repr(result.exception)
        assert "bounds this run" in result.output
        outs[workers] = out
    a, b = vectors(outs["0"]), vectors(outs["2"])
    assert len(a) == 599 and sorted(a) == sorted(b)
    ids = sorted(a)
    assert cosine(np.stack([a[i] for i in ids]), np.stack([b[i] for i in ids])).min() >= 0.999999
    (error,) = [json.loads(x) for x in (outs["2"] / "errors-00000.jsonl").open()]
    assert error["id"] == "bad" and "empty text" in json.dumps(error)
