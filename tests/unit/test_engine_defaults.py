"""The engine's automatic sizes: max_running 512 and 4,096-token prefill chunks on CUDA, 1,024
and 12,288 for a 3B+ model there, 256 and 4,096 on the CPU (the measured reasons are in
batchrun/config.py); the CLI's kernel options as EngineConfig's kernel choices; the kernel plan
an engine on the CPU resolves and hands to its blocks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import LLAMA3_SHAPES, llama3_model_config, write_config_dir  # noqa: E402

from batchrun.config import (  # noqa: E402
    CHUNKED_PREFILL,
    CHUNKED_PREFILL_LARGE,
    GPU_MEMORY_UTILIZATION,
    MAX_RUNNING,
    MAX_RUNNING_CUDA,
    MAX_RUNNING_LARGE,
    EngineConfig,
    KernelPlan,
    auto_sizes,
    resolve_sizes,
)


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
def test_auto_sizes_by_model_and_device(name, device, expected):
    assert name in LLAMA3_SHAPES
    assert auto_sizes(llama3_model_config(name), device) == expected


def test_an_explicit_max_running_is_kept():
    cfg = llama3_model_config("llama-8b")
    assert resolve_sizes(EngineConfig(max_running=7, device="cuda"), cfg).max_running == 7
    auto = resolve_sizes(EngineConfig(device="cuda"), cfg)
    assert auto.max_running == MAX_RUNNING_LARGE


def tiny_engine(tmp_path, kernels: KernelPlan | None = None, **config):
    from batchrun.engine.engine import Engine

    model = str(write_config_dir("tiny", tmp_path))
    return Engine(EngineConfig(model=model, load_format="dummy", device="cpu", **config), kernels)


def test_the_engine_resolves_it(tmp_path):
    engine = tiny_engine(tmp_path, kv_budget=4096)
    assert engine.config.max_running == MAX_RUNNING
    assert engine.scheduler.max_running == MAX_RUNNING
    assert engine.scheduler.prefill_budget == CHUNKED_PREFILL


KERNEL_CHOICES = ("reference_kernels", "cuda_graph_max_bs", "piecewise_graphs", "pdl",
                  "host_gate", "dequantize", "overlap")  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], {}),
        (["--reference-kernels"], dict(reference_kernels=True)),
        (["--dequantize"], dict(dequantize=True)),
        (["--cuda-graph-max-bs", "64"], dict(cuda_graph_max_bs=64)),
        (["--disable-cuda-graph"], dict(cuda_graph_max_bs=0)),
        (["--disable-piecewise-cuda-graph"], dict(piecewise_graphs=False)),
        (["--disable-pdl"], dict(pdl=False)),
        (["--disable-host-gate"], dict(host_gate=False)),
        (["--disable-overlap"], dict(overlap=False)),
    ],
)
def test_cli_switches_reach_the_engine_config(flags, expected):
    """submit's kernel options set their EngineConfig field (the user's kernel choices; the
    plan is the engine's to resolve), every other one keeps its default."""
    config = _cli_config(["--device", "cpu", *flags])
    default = EngineConfig()
    got = {name: getattr(config, name) for name in KERNEL_CHOICES}
    assert got == {**{name: getattr(default, name) for name in KERNEL_CHOICES}, **expected}


def test_the_cli_has_no_plan_options():
    """The plan's fields are no CLI options (a benchmark overrides them): click refuses them."""
    for flag in ("--attention-backend", "--extend-attention", "--decode-gemv", "--moe-kernel"):
        assert "No such option" in _cli_config(["--device", "cpu", flag, "torch"], exit_code=2)


def _cli_config(args: list[str], exit_code: int = 0):
    """The EngineConfig that build_engine_config makes of submit's engine options `args`; with
    an exit_code other than 0, the CLI's output instead."""
    import click
    from click.testing import CliRunner

    from batchrun.cli.build import build_engine_config
    from batchrun.cli.options import engine_options

    seen = {}

    @click.command()
    @engine_options
    def cmd(**o):
        seen["config"] = build_engine_config({**o, "model": None, "load_format": "auto", "seed": 0})

    result = CliRunner().invoke(cmd, args)
    assert result.exit_code == exit_code, result.output
    return seen["config"] if exit_code == 0 else result.output


def test_decode_gemv_defaults_to_cublas_off_cuda(tmp_path):
    """decode_gemv "auto" picks kernels/gemv.py only where PDL is on (a CUDA GPU of sm_90+:
    tests/unit/test_kernel_choice.py, tests/gpu/test_pdl.py); on the CPU the engine resolves it
    to cuBLAS, as every other kernel field to plain torch, and the model's blocks carry that
    config."""
    for mode in ("auto", "cublas"):
        engine = tiny_engine(tmp_path, kv_budget=64, kernels=KernelPlan(decode_gemv=mode))
        assert engine.kernels.decode_gemv == "cublas", mode
        assert engine.kernels == KernelPlan.reference()
        model = engine.runner.model
        assert model.layers[0].mlp.down_proj.kernels == engine.kernels
        assert model.kernels == engine.runner.kernels == engine.kernels
    with pytest.raises(ValueError, match="decode_gemv"):
        KernelPlan(decode_gemv="fast").validate()


def test_gpu_memory_utilization_sizes_the_cuda_kv_pool(monkeypatch):
    """The KV pool takes that fraction of the GPU memory free after the weights (--kv-budget,
    when given, instead)."""
    from types import SimpleNamespace

    import torch

    from batchrun.engine.kv_sizing import kv_slots

    free = 10 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    model_cfg = SimpleNamespace(num_layers=4, head_dim=64, kv_layers=(0, 1, 2, 3))
    per_token = 2 * 4 * 2 * 64 * 2  # k and v, layers, kv heads, head dim, bf16

    def slots(**config):
        # every layer in the one pool (no window pool): (its slots, 0)
        num_slots, num_window = kv_slots(
            EngineConfig(**config), model_cfg, ((2, 64),) * 4, (),
            device=torch.device("cuda"), dtype=torch.bfloat16, prefill_budget=4096,
        )  # fmt: skip
        assert num_window == 0
        return num_slots

    assert slots() == int(free * GPU_MEMORY_UTILIZATION) // per_token
    assert slots(gpu_memory_utilization=0.5) == int(free * 0.5) // per_token
    assert slots(gpu_memory_utilization=0.5, kv_budget=1000) == 1000
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            EngineConfig(gpu_memory_utilization=bad).validate()


def test_cli_gpu_memory_utilization(monkeypatch):
    import torch

    assert _cli_config(["--device", "cpu"]).gpu_memory_utilization == GPU_MEMORY_UTILIZATION
    for value in ("0", "1.5", "x"):
        out = _cli_config(["--gpu-memory-utilization", value], exit_code=2)
        assert "--gpu-memory-utilization" in out
    out = _cli_config(["--device", "cpu", "--gpu-memory-utilization", "0.5"], exit_code=2)
    assert "on the CPU the pool takes an eighth of the available memory" in out
    assert "--kv-budget" in out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = _cli_config(["--device", "cuda", "--gpu-memory-utilization", "0.6"])
    assert config.gpu_memory_utilization == 0.6
    out = _cli_config(
        ["--device", "cuda", "--gpu-memory-utilization", "0.6", "--kv-budget", "4096"], exit_code=2
    )
    assert "--gpu-memory-utilization and --kv-budget both size the KV pool" in out
