"""The engine's automatic sizes: max_running 512 and 4,096-token prefill chunks on CUDA, 1,024
and 12,288 for a 3B+ model there, 256 and 4,096 on the CPU (the measured reasons are in
batchrun/config.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_models import MODELS, write_model_dir  # noqa: E402

from batchrun.config import (  # noqa: E402
    CHUNKED_PREFILL,
    CHUNKED_PREFILL_LARGE,
    MAX_RUNNING,
    MAX_RUNNING_CUDA,
    MAX_RUNNING_LARGE,
    EngineConfig,
    auto_sizes,
    resolve_sizes,
)
from batchrun.models.config import ModelConfig  # noqa: E402


def model_config(name: str, tmp_path) -> ModelConfig:
    return ModelConfig.from_dir(write_model_dir(name, tmp_path))


@pytest.mark.parametrize(
    ("name", "device", "expected"),
    [
        ("llama-8b", "cuda", (MAX_RUNNING_LARGE, CHUNKED_PREFILL_LARGE)),
        ("llama-8b", "cpu", (MAX_RUNNING, CHUNKED_PREFILL)),
        ("llama-1b", "cuda", (MAX_RUNNING_CUDA, CHUNKED_PREFILL)),
        ("llama-1b", "cpu", (MAX_RUNNING, CHUNKED_PREFILL)),
        ("tiny", "cuda", (MAX_RUNNING_CUDA, CHUNKED_PREFILL)),
    ],
)
def test_auto_sizes_by_model_and_device(name, device, expected, tmp_path):
    assert name in MODELS
    assert auto_sizes(model_config(name, tmp_path), device) == expected


def test_an_explicit_max_running_is_kept(tmp_path):
    cfg = model_config("llama-8b", tmp_path)
    assert resolve_sizes(EngineConfig(max_running=7, device="cuda"), cfg).max_running == 7
    auto = resolve_sizes(EngineConfig(device="cuda"), cfg)
    assert auto.max_running == MAX_RUNNING_LARGE


def test_the_engine_resolves_it(tmp_path):
    from batchrun.engine.engine import Engine

    engine = Engine(
        EngineConfig(
            model=str(write_model_dir("tiny", tmp_path)),
            load_format="dummy",
            device="cpu",
            kv_budget=4096,
        )
    )
    assert engine.config.max_running == MAX_RUNNING
    assert engine.scheduler.max_running == MAX_RUNNING
    assert engine.scheduler.prefill_budget == CHUNKED_PREFILL


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], dict(cuda_graph_max_bs=EngineConfig.cuda_graph_max_bs, piecewise_cuda_graph=None)),
        (["--disable-cuda-graph"], dict(cuda_graph_max_bs=0, piecewise_cuda_graph=None)),
        (["--disable-piecewise-cuda-graph"], dict(piecewise_cuda_graph=False)),
        (["--disable-overlap"], dict(overlap=False)),
        ([], dict(decode_gemv="auto")),
        (["--decode-gemv", "cublas"], dict(decode_gemv="cublas")),
    ],
)
def test_cli_switches_reach_the_engine_config(flags, expected):
    """submit's --disable-cuda-graph / --disable-piecewise-cuda-graph / --disable-overlap /
    --decode-gemv."""
    import click

    from batchrun.cli.options import build_engine_config, engine_options

    seen = {}

    @click.command()
    @engine_options
    def cmd(**o):
        seen["config"] = build_engine_config({**o, "model": None, "load_format": "auto", "seed": 0})

    from click.testing import CliRunner

    result = CliRunner().invoke(cmd, ["--device", "cpu", *flags])
    assert result.exit_code == 0, result.output
    config = seen["config"]
    for name, value in expected.items():
        assert getattr(config, name) == value, name
    assert config.overlap is (False if "--disable-overlap" in flags else None)


def test_decode_gemv_defaults_to_cublas_off_cuda(tmp_path):
    """EngineConfig.decode_gemv "auto" picks kernels/gemv.py only on a PDL-capable GPU (CUDA
    runs check the rest: tests/gpu/test_pdl.py); on the CPU nothing changes."""
    from batchrun.engine.engine import Engine

    base = dict(
        model=str(write_model_dir("tiny", tmp_path)),
        load_format="dummy",
        device="cpu",
        kv_budget=64,
    )
    for mode, want in (("auto", None), ("cublas", None), ("triton", "all")):
        engine = Engine(EngineConfig(**base, decode_gemv=mode))
        model = engine.runner.model
        assert model.decode_gemv == want, mode
        assert model.layers[0].mlp.down_proj.decode_gemv == want
    with pytest.raises(ValueError, match="decode_gemv"):
        EngineConfig(decode_gemv="fast").validate()
