"""scripts/bench_pooling.py on the CPU: --help, and a tiny run of each case writing its JSON."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_pooling.py"


def test_help_names_the_cases():
    out = subprocess.run([sys.executable, "-P", str(SCRIPT), "--help"], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    assert "qwen3-rerank-0.6b" in out and "--st-batch-sizes" in out


def test_rerank_pairs_tokenize_as_the_job(tmp_path):
    """CrossEncoder's pair (prefix + instruction + query, document + suffix) on the twin's
    tokenizer is the token sequence of batchrun's rerank prompt."""
    from transformers import AutoTokenizer

    from batchrun.pooling.model import RowTokenizer

    spec = importlib.util.spec_from_file_location("bench_pooling", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    path = bench.make_model(tmp_path, "qwen3-rerank-0.6b", True, "cpu")
    ours = RowTokenizer(AutoTokenizer.from_pretrained(path), 4096, "decoder")
    twin = AutoTokenizer.from_pretrained(bench.seq_cls_twin(path))
    docs = bench.passages(3, 2000, 2, 4, 12)
    for (first, second), doc in zip(bench.rerank_pairs("w1 w2 w3", docs), docs, strict=True):
        job = ours.tokenize_yes_no("w1 w2 w3", doc, None).input_ids
        assert twin(first, second)["input_ids"] == list(job)


@pytest.mark.slow  # CI's slow tier (BATCHRUN_SLOW_TESTS=1): four models, ~90 s on two cores
def test_tiny_cpu_run(tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, "-P", str(SCRIPT), "--device", "cpu", "--tiny", "--scale", "0.0001",
         "--tokenizer-workers", "1", "--st-batch-sizes", "8", "--out", str(out)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    rows = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"bert-base", "qwen3-embed-0.6b", "qwen3-rerank-0.6b", "reward-llama-8b"}
    assert rows["bert-base"]["batchrun"]["rows"] == 20
    assert rows["bert-base"]["sentence_transformers"]["rows_per_s"] > 0
    assert rows["qwen3-rerank-0.6b"]["batchrun"]["rows"] == 2
    assert rows["qwen3-rerank-0.6b"]["batchrun"]["cached_tokens"] > 0
    assert rows["qwen3-rerank-0.6b"]["sentence_transformers"]["rows_per_s"] > 0
    # the job's P(yes) against CrossEncoder.predict on the seq-cls twin, fp32, the same tokens
    check = rows["qwen3-rerank-0.6b"]["check"]
    assert check["pairs"] == 20 and check["max_abs_diff"] < 1e-5
    assert rows["reward-llama-8b"]["batchrun"]["prefill_tflop_per_s"] > 0
