"""Quantized checkpoints through the CLI: a checkpoint batchrun cannot run fails at start-up
with exit 4 and a message naming the field or tensor (no row runs); --quantization is refused
with exit 2 where it cannot apply; `plan` reports the weights' format; a quantized run
completes and --quantization is part of the run's fingerprint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quant_checkpoints import write_quantized  # noqa: E402
from quant_cli import dataset, edit_quant_config, submit  # noqa: E402
from tiny_models import save_byte_tokenizer  # noqa: E402

from batchrun.cli import main  # noqa: E402
from batchrun.job.resume import model_identity  # noqa: E402

SCALES = "model-00002-of-00002.safetensors"  # quant_checkpoints puts the scales there


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ct-fp8")
    write_quantized("ct-fp8-channel", "llama", path)
    save_byte_tokenizer(path)
    return path


@pytest.fixture
def broken(fp8_dir, tmp_path) -> Path:
    """A copy of the good checkpoint to break."""
    for f in fp8_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    return tmp_path


def edit_scales(path: Path, edit) -> None:
    tensors = load_file(str(path / SCALES))
    edit(tensors)
    save_file(tensors, str(path / SCALES))


def weights_of(group: dict) -> dict:
    return group["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize(
    "breaking,message",
    [
        (
            lambda p: edit_quant_config(p, lambda q: q.update(quant_method="bitsandbytes")),
            "quant_method 'bitsandbytes' is not supported; supported: compressed-tensors",
        ),
        (
            lambda p: edit_quant_config(p, lambda q: weights_of(q).update(num_bits=3)),
            "weights.num_bits 3 is not supported; supported: 8",
        ),
        (
            lambda p: edit_quant_config(
                p, lambda q: weights_of(q).update(strategy="group", group_size=64)
            ),
            "weights.strategy 'group' is not supported; supported: tensor, channel, block",
        ),
        (
            lambda p: edit_scales(p, lambda t: t.pop("model.layers.0.mlp.up_proj.weight_scale")),
            "lacks model.layers.0.mlp.up_proj.weight_scale, which fp8 (compressed-tensors",
        ),
        (
            lambda p: edit_scales(
                p,
                lambda t: t.update(
                    {
                        "model.layers.1.self_attn.k_proj.weight_scale": t.pop(
                            "model.layers.1.self_attn.k_proj.weight_scale"
                        )[:16]
                    }
                ),
            ),
            "model.layers.1.self_attn.k_proj.weight_scale has shape (16, 1) float32; "
            "compressed-tensors FP8 (per-channel weights) expects shape (32, 1) or (32,)",
        ),
    ],
)
def test_a_checkpoint_batchrun_cannot_run_exits_4_before_any_row(
    broken, tmp_path, breaking, message
):
    breaking(broken)
    result = submit(broken, tmp_path / "run", "--in-process")
    assert result.exit_code == 4, result.output
    assert message in result.output, result.output
    assert "Traceback" not in result.output
    assert not list((tmp_path / "run" / "out").glob("results-*.jsonl"))


def test_the_engine_process_reports_it_the_same(broken, tmp_path):
    edit_quant_config(broken, lambda q: weights_of(q).update(num_bits=3))
    result = submit(broken, tmp_path)
    assert result.exit_code == 4 and "weights.num_bits 3" in result.output, result.output


def test_a_quantized_run_completes_and_quantization_is_in_its_fingerprint(fp8_dir, tmp_path):
    result = submit(fp8_dir, tmp_path, "--in-process")
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["kernels"]["fp8_matmul"] == "dequant"
    assert "quantization" not in manifest["fingerprint"]["model"]
    assert model_identity(str(fp8_dir), "auto", "fp8")["quantization"] == "fp8"


def test_quantization_is_refused_where_it_cannot_apply(fp8_dir, tmp_path):
    result = submit(fp8_dir, tmp_path, "--quantization", "fp8")
    assert result.exit_code == 2, result.output
    assert "quantized already" in result.output and "compressed-tensors" in result.output
    result = CliRunner().invoke(
        main,
        ["submit", str(dataset(tmp_path)), "--out", str(tmp_path / "o"), "--quantization", "fp8"],
    )
    assert result.exit_code == 2 and "GGUF model" in result.output, result.output


def test_plan_reports_the_weights_format(fp8_dir, tmp_path):
    result = CliRunner().invoke(
        main, ["plan", str(dataset(tmp_path)), "--model", str(fp8_dir), "--no-chat-template"]
    )
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if x.startswith("weights"))
    assert "fp8 (compressed-tensors, per-channel weights, dynamic per-token activations)" in line
    assert "in 2 safetensors files" in line
