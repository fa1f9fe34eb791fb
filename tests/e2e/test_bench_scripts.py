"""The GPU benchmarks' own CPU smoke modes (their docstrings give the commands): they must run
through the engine's current API, so that a session's GPU minutes are not lost to a script that
broke on the CPU (bench_throughput's latency probe once did, after Engine._process changed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_script(name: str, *args: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / name), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_bench_throughput_cpu_smoke(tmp_path):
    run_script(
        "bench_throughput.py", "--device", "cpu", "--models", "tiny", "--workloads", "W1,W3",
        "--scale", "0.005", "--variants", "batchrun,no-overlap", "--out", str(tmp_path),
    )  # fmt: skip
    results = json.loads((tmp_path / "bench_throughput.json").read_text())["results"]
    assert len(results) == 4
    for r in results:
        assert r["status"] == "ok", r
        assert r["output_tokens"] > 0 and r["ttft_p50_ms"] is not None, r


def test_bench_structured_cpu_smoke(tmp_path):
    pytest.importorskip("xgrammar")
    run_script(
        "bench_structured.py", "--device", "cpu", "--model", "tiny", "--num-prompts", "8",
        "--prompt-len", "16", "--output-len", "16", "--repeats", "1", "--phases",
        "--out", str(tmp_path),
    )  # fmt: skip
    report = json.loads((tmp_path / "bench_structured.json").read_text())
    assert report["free_tok_s"] > 0 and report["json_schema_tok_s"] > 0
    run = report["runs"][f"json_schema {report['fill_settings'][0]}"][0]
    assert run["phases_ms_per_step"]["fill_wait"] >= 0 and "accept_ms_per_step" in run
    assert run["gated_steps"] == 0  # no host gate on the CPU


def test_bench_gemv_shapes_and_no_gpu_exit(tmp_path):
    """bench_gemv's matrices are the models' linear layers; without CUDA it says so and exits."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_gemv import shapes

    one_b = {name: (n, k, count) for name, n, k, count in shapes("llama-1b")}
    assert one_b["qkv"] == (3072, 2048, 16) and one_b["down"] == (2048, 8192, 16)
    assert one_b["lm_head"] == (128256, 2048, 1)
    eight_b = {name: (n, k) for name, n, k, _ in shapes("llama-8b")}
    assert eight_b["gate_up"] == (28672, 4096) and eight_b["o"] == (4096, 4096)
    import torch

    if not torch.cuda.is_available():
        run_script("bench_gemv.py", "--out", str(tmp_path))


def test_method_timers_on_a_class_time_every_instance_and_restore_it():
    """host_phases times Triton's launches with a timer on JITFunction itself; close() must put
    the class's own method back, and an instance's timer must leave its class alone."""
    sys.path.insert(0, str(REPO / "scripts"))
    from host_phases import MethodTimers

    class Kernel:
        def run(self, x):
            return x + 1

    own = Kernel.__dict__["run"]
    holder = type("Holder", (), {"Kernel": Kernel})()
    timers = MethodTimers(holder, (("launch", "Kernel", "run"),))
    assert Kernel().run(1) == 2 and Kernel().run(2) == 3
    assert timers.calls["launch"] == 2 and timers.seconds["launch"] > 0
    timers.close()
    assert Kernel.__dict__["run"] is own
    one = Kernel()
    timers = MethodTimers(type("Root", (), {"k": one})(), (("one", "k", "run"),))
    assert one.run(1) == 2 and timers.calls["one"] == 1
    timers.close()
    assert "run" not in vars(one) and Kernel.__dict__["run"] is own


def test_bench_throughput_has_a_config_for_every_engine_variant():
    """Every variant but HF's gives an engine config (one switch variant missing from the
    config table once failed at start-up on the GPU, a device call's row lost)."""
    import argparse

    sys.path.insert(0, str(REPO / "scripts"))
    import bench_throughput

    args = argparse.Namespace(
        device="cpu", dtype="float32", attention_backend="auto", max_running=8, kv_budget=1024,
        cuda_graph_max_bs=4, chunked_prefill_size=256, page_size=1,
    )  # fmt: skip
    for variant in bench_throughput.VARIANTS:
        if variant != "hf":
            assert bench_throughput.engine_config(args, REPO, variant).model == str(REPO)


def test_compile_log_phases_and_hooks():
    """scripts/triton_compiles.py: the variants Triton builds, by phase (fed by hand here: the
    CPU has no compiler), and its hooks in Triton's runtime knobs put back on close."""
    sys.path.insert(0, str(REPO / "scripts"))
    from triton_compiles import CompileLog

    class Fn:
        name = "_kernel"

    log = CompileLog()
    for phase, key in (("warm-up", "a"), ("timed", "b"), ("timed", "c")):
        log.phase = phase
        assert log.before_compile(key=key, repr=f"_kernel[{key}]") is False  # never skips
        log.after_compile(key=key, fn=Fn())
    assert log.summary("start-up") == "none"
    assert [e.detail for e in log.take("timed")] == ["_kernel[b]", "_kernel[c]"]
    assert [e.phase for e in log.events] == ["warm-up", "timed", "timed"]
    assert log.summary("timed").startswith("2 variants") and "_kernel x2" in log.summary("timed")
    log.reset()
    assert not log.events and log.phase == "start-up"

    knobs = pytest.importorskip("triton").knobs
    before = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    installed = CompileLog.install()
    assert installed is not None
    assert knobs.runtime.jit_post_compile_hook == installed.after_compile
    installed.close()
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == before


def test_source_tree_names_the_commit_or_the_dirty_tree(tmp_path):
    """scripts/source_tree.py: a clean checkout is its short HEAD; one with changes (edited and
    untracked files) is "HEAD+dirty (tree T)" with T the tree its commit will have, hashed in a
    scratch index that leaves the repository's own untouched."""
    sys.path.insert(0, str(REPO / "scripts"))
    from source_tree import git_commit

    def git(*args):
        return subprocess.check_output(["git", *args], cwd=tmp_path, text=True).strip()

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / "a.py").write_text("one\n")
    git("add", "a.py")
    git("commit", "-qm", "one")
    assert git_commit(tmp_path) == git("rev-parse", "--short", "HEAD")
    (tmp_path / "a.py").write_text("two\n")
    (tmp_path / "b.py").write_text("new\n")
    got = git_commit(tmp_path)
    assert got.startswith(git("rev-parse", "--short", "HEAD") + "+dirty (tree ")
    assert "?? b.py" in git("status", "--porcelain")  # the real index is untouched
    git("add", "-A")
    git("commit", "-qm", "two")
    assert got.endswith(f"(tree {git('log', '-1', '--format=%T')[:10]})")
