"""`batchrun submit --tp N --dp M` on the CPU (gloo): every combination gives the outputs of one
engine. Tensor-parallel ranks and data-parallel engine processes are real processes here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_tiny_chat_model  # noqa: E402

from batchrun.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tinychat")
    make_tiny_chat_model(path)  # 4 attention heads, 2 KV heads: splits over 2 ranks
    return str(path)


def run(model: str, ds: Path, out: Path, *extra: str) -> dict[str, str]:
    argv = ["submit", str(ds), "--out", str(out), "--model", model, "--device", "cpu",
            "--max-tokens", "8", "--temperature", "0", "--kv-budget", "4096", "--quiet",
            *extra]  # fmt: skip
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0, (r.output, r.exception)
    recs = [json.loads(x) for p in out.glob("results-*.jsonl") for x in p.read_text().splitlines()]
    return {rec["id"]: rec["text"] for rec in recs}


def test_tp2_and_dp2_tp2_equal_one_engine(model, tmp_path):
    ds = tmp_path / "in.jsonl"
    rows = [{"id": f"r{i}", "prompt": f"Topic {i % 3}: say something about {i}"} for i in range(16)]
    ds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    one = run(model, ds, tmp_path / "one", "--in-process")
    assert len(one) == 16
    assert run(model, ds, tmp_path / "tp2", "--tp", "2") == one
    assert run(model, ds, tmp_path / "dp2tp2", "--dp", "2", "--tp", "2") == one


def test_tp_that_does_not_divide_the_heads_fails_fast(model, tmp_path):
    ds = tmp_path / "in.jsonl"
    ds.write_text('{"prompt": "hi"}\n')
    r = CliRunner().invoke(
        main,
        [
            "submit",
            str(ds),
            "--out",
            str(tmp_path / "o"),
            "--model",
            model,
            "--device",
            "cpu",
            "--tp",
            "3",
        ],
    )
    assert r.exit_code == 4 and "3" in r.output, r.output
