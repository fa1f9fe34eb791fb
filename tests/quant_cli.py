"""What the CLI tests of quantized checkpoints share: a three-row dataset, a short CPU `submit`,
and an edit of a checkpoint's quantization_config."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from batchrun.cli import main


def dataset(tmp_path: Path) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(3)))
    return path


def submit(model: Path, tmp_path: Path, *extra: str):
    args = ["submit", str(dataset(tmp_path)), "--out", str(tmp_path / "out"), "--model", str(model)]
    args += ["--device", "cpu", "--max-tokens", "4", "--quiet", "--no-chat-template", *extra]
    return CliRunner().invoke(main, args)


def edit_quant_config(path: Path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))
