"""A run writes the kernel config its engine resolved into manifest.json ("kernels"), in the
engine process and in process alike: on the CPU, plain PyTorch everywhere."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_tiny_chat_model  # noqa: E402

from batchrun.cli import main  # noqa: E402
from batchrun.config import KernelPlan  # noqa: E402


@pytest.mark.parametrize("process", ["--engine-process", "--in-process"])
def test_manifest_records_the_resolved_kernels(tmp_path, process):
    model = tmp_path / "model"
    make_tiny_chat_model(model)
    data = tmp_path / "rows.jsonl"
    data.write_text('{"id": "a", "prompt": "Hello"}\n{"id": "b", "prompt": "Count to three"}\n')
    out = tmp_path / "out"
    args = ["submit", str(data), "--out", str(out), "--model", str(model), "--device", "cpu"]
    args += ["--max-tokens", "4", "--temperature", "0", "--kv-budget", "1024", "--quiet", process]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, (result.output, result.exception)
    kernels = json.loads((out / "manifest.json").read_text())["kernels"]
    assert kernels == dataclasses.asdict(KernelPlan.reference())
