"""A mixture of experts through the CLI: `plan` reports its total and active parameters,
`submit` runs it (on the CPU: the experts on the torch loop) and logs the same counts
at start-up, and a tensor-parallel size that does not split the experts is refused by name
(before any process starts)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_moe_config, save_byte_tokenizer  # noqa: E402

from batchrun.cli.main import main  # noqa: E402

ROWS = [{"id": "a", "prompt": "Hello there"}, {"id": "b", "prompt": "Two plus two?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tinymoe")
    cfg = make_moe_config("qwen2_moe", vocab_size=260, eos_token_id=257, bos_token_id=258,
                          pad_token_id=259, max_position_embeddings=1024,
                          moe_intermediate_size=30)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval().save_pretrained(path)
    save_byte_tokenizer(path)
    return str(path)


def dataset(tmp_path: Path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def test_plan_reports_total_and_active_parameters(model, tmp_path):
    r = CliRunner().invoke(main, ["plan", str(dataset(tmp_path)), "--model", model])
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if x.startswith("parameters"))
    # 3 layers of 6 experts (30 wide), 3 a token, a shared expert 48 wide
    assert "M parameters, " in line and "M active a token" in line, line
    assert "(3 of 6 experts a token in 3 of 3 layers, and a shared expert)" in line, line


def test_submit_runs_and_logs_the_counts(model, tmp_path, caplog):
    out = tmp_path / "o"
    args = ["submit", str(dataset(tmp_path)), "--out", str(out), "--model", model, "--device",
            "cpu", "--max-tokens", "6", "--temperature", "0", "--kv-budget", "2048", "--quiet",
            "--in-process"]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="batchrun"):
        r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, (r.output, r.exception)
    records = [json.loads(x) for x in next(out.glob("results-*.jsonl")).read_text().splitlines()]
    assert {rec["id"] for rec in records} == {"a", "b"}
    assert all(rec["usage"]["completion_tokens"] == 6 for rec in records)
    weights = next(m for m in caplog.messages if m.startswith("weights: "))
    assert "active a token (3 of 6 experts a token" in weights
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kernels"]["moe"] == "torch"


def test_tp_that_does_not_split_the_experts_is_refused(model, tmp_path):
    args = ["submit", str(dataset(tmp_path)), "--out", str(tmp_path / "o"), "--model", model,
            "--device", "cpu", "--tp", "4", "--quiet"]  # fmt: skip
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 4, r.output
    assert "the expert width (moe_intermediate_size) 30 does not split evenly over 4" in r.output
