"""INT4 checkpoints through the CLI: a GPTQ checkpoint runs to completion and `plan` names its
format; one batchrun cannot run (bits 3, an unsupported group size or AWQ version, a missing
or misshapen scale) fails at start-up with exit 4 and a message naming the field or tensor, before
any row runs; --quantization fp8 is refused for it (exit 2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quant_checkpoints import make_fp32_model  # noqa: E402
from quant_checkpoints_int4 import write_int4_checkpoint  # noqa: E402
from quant_cli import dataset, edit_quant_config, submit  # noqa: E402
from tiny_models import save_byte_tokenizer  # noqa: E402

from batchrun.cli import main  # noqa: E402


def write(fmt: str, path: Path, **kw) -> Path:
    write_int4_checkpoint(fmt, make_fp32_model("llama"), path, **kw)
    save_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gptq")
    return write("gptq", path, group_size=32, symmetric=False, act_order=True)


def edit_tensor(path: Path, name: str, edit) -> None:
    """Replace tensor `name` (in whichever shard file holds it) by edit(tensor); None drops it."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = path / index["weight_map"][name]
    tensors = load_file(str(shard))
    new = edit(tensors.pop(name))
    if new is not None:
        tensors[name] = new
    save_file(tensors, str(shard))


def test_a_gptq_run_completes_and_plan_names_the_format(gptq_dir, tmp_path):
    result = submit(gptq_dir, tmp_path, "--in-process")
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    result = CliRunner().invoke(
        main, ["plan", str(dataset(tmp_path)), "--model", str(gptq_dir), "--no-chat-template"]
    )
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if x.startswith("weights"))
    assert "int4 (GPTQ v1, group size 32, zero points, act-order)" in line, line


LINEAR = "model.layers.1.mlp.down_proj"


@pytest.mark.parametrize(
    "fmt,breaking,message",
    [
        ("gptq", lambda p: edit_quant_config(p, lambda q: q.update(bits=3)), "bits 3 is not"),
        (
            "pack-quantized",
            lambda p: edit_quant_config(
                p, lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=16)
            ),
            "weights.group_size 16 is not supported; supported: 32, 64, 128",
        ),
        (
            "awq",
            lambda p: edit_quant_config(p, lambda q: q.update(version="gemv")),
            "version 'gemv' is not supported; supported: gemm (AWQ)",
        ),
        (
            "awq",
            lambda p: edit_tensor(p, f"{LINEAR}.scales", lambda t: None),
            f"lacks {LINEAR}.scales, which int4 (AWQ GEMM",
        ),
        (
            "pack-quantized",
            lambda p: edit_tensor(p, f"{LINEAR}.weight_scale", lambda t: t[:, :1].contiguous()),
            f"{LINEAR}.weight_scale has shape (64, 1) bfloat16",
        ),
    ],
)
def test_a_checkpoint_batchrun_cannot_run_exits_4_before_any_row(fmt, breaking, message, tmp_path):
    model = write(fmt, tmp_path / "model", group_size=32, symmetric=False)
    breaking(model)
    result = submit(model, tmp_path / "run", "--in-process")
    assert result.exit_code == 4, result.output
    assert message in result.output, result.output
    assert "Traceback" not in result.output
    assert not list((tmp_path / "run" / "out").glob("results-*.jsonl"))


def test_quantization_fp8_is_refused_for_an_int4_checkpoint(gptq_dir, tmp_path):
    result = submit(gptq_dir, tmp_path, "--quantization", "fp8")
    assert result.exit_code == 2, result.output
    assert "quantized already" in result.output and "gptq" in result.output, result.output
