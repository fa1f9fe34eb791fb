"""The benchmark scripts on the CPU: each one that can run there runs its smoke command (its
docstring gives it) as `python scripts/NAME.py` from the checkout, through the engine's current
API, with the tiny model; the GPU-only ones say so and exit. Their shared helpers (benchlib.py)
and instrumentation (host_phases.py, triton_compiles.py) are checked against the engine's
classes, so that a GPU run does not find a script broken by a change to the engine."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from batchrun.config import EngineConfig, KernelPlan
from batchrun.engine.engine import Engine

pytestmark = pytest.mark.slow  # CI's slow tier (BATCHRUN_SLOW_TESTS=1)

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(SCRIPTS))

import benchlib  # noqa: E402
from host_phases import PHASES, HostPhases, MethodTimers  # noqa: E402
from triton_compiles import CompileLog  # noqa: E402

CPU_KERNELS = dataclasses.asdict(KernelPlan.reference())  # what every CPU engine resolves to


def run_script(name: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def tiny_engine(tmp_path: Path) -> Engine:
    model_dir = benchlib.write_model_dir("tiny", tmp_path)
    return Engine(EngineConfig(model=str(model_dir), load_format="dummy", device="cpu"))


# -- bench_throughput ----------------------------------------------------------------------------


def test_bench_throughput_cpu_smoke(tmp_path):
    run_script(
        "bench_throughput.py", "--device", "cpu", "--models", "tiny", "--workloads", "W1,W3",
        "--scale", "0.002", "--variants", "batchrun,no-overlap,hf", "--warmup-requests", "2",
        "--out", str(tmp_path),
    )  # fmt: skip
    results = json.loads((tmp_path / "bench_throughput.json").read_text())["results"]
    assert [(r["variant"], r["workload"]) for r in results] == [
        (v, w) for v in ("batchrun", "no-overlap", "hf") for w in ("W1", "W3")
    ]
    for r in results:
        assert r["status"] == "ok", r
        assert r["output_tokens"] > 0 and r["ttft_p50_ms"] is not None, r
        # each engine's resolved kernel config is in its rows; HF has none
        assert r["kernels"] == (None if r["variant"] == "hf" else CPU_KERNELS), r
    w3 = next(r for r in results if r["workload"] == "W3")
    assert w3["ms_per_token"] > 0 and w3["num_requests"] == 1
    report = (tmp_path / "bench_throughput.md").read_text()
    resolved = "- tiny batchrun: attention=torch, extend_attention=triton, triton_ops"
    assert f"Kernel configs (resolved):\n{resolved}" in report


def test_bench_throughput_long_documents_cpu_smoke(tmp_path):
    """W5 at 1 of its 256 prompts (16,384 tokens): the model gets a 128k context, the row its
    prefill TFLOP/s."""
    run_script(
        "bench_throughput.py", "--device", "cpu", "--models", "tiny", "--workloads", "W5",
        "--scale", "0.004", "--variants", "batchrun", "--warmup-requests", "1",
        "--out", str(tmp_path),
    )  # fmt: skip
    (r,) = json.loads((tmp_path / "bench_throughput.json").read_text())["results"]
    assert r["status"] == "ok" and r["num_requests"] == 1, r
    assert r["prompt_tokens"] == 16384 and r["output_tokens"] == 128, r
    assert r["prefill_tflops"] > 0, r
    assert "prefill TFLOP/s" in (tmp_path / "bench_throughput.md").read_text()


def test_bench_throughput_variants_change_only_the_config():
    """Every engine variant is its options' EngineConfig and plan overrides with the fields
    VARIANTS names changed (--attention-backend and --kernel feed the plan's overrides, a
    variant's fields win over them; --cuda-graph-max-bs is the EngineConfig's)."""
    import bench_throughput

    args = bench_throughput.parse_args(
        ["--device", "cpu", "--attention-backend", "torch", "--cuda-graph-max-bs", "4",
         "--max-running", "8", "--kv-budget", "1024", "--kernel", "decode_norms=fold-all",
         "--kernel", "pdl=auto", "--kernel", "triton_ops=false"]
    )  # fmt: skip
    base, base_kernels = bench_throughput.engine_config(args, REPO, "batchrun")
    assert base_kernels == KernelPlan(
        attention="torch", decode_norms="fold-all", pdl=None, triton_ops=False
    )
    assert (base.model, base.load_format, base.device, base.dtype) == (
        str(REPO), "dummy", "cpu", "float32"
    )  # fmt: skip
    assert (base.max_running, base.kv_budget, base.overlap, base.cuda_graph_max_bs) == (
        8, 1024, True, 4
    )  # fmt: skip
    for variant, (engine_fields, kernel_fields) in bench_throughput.VARIANTS.items():
        cfg, kernels = bench_throughput.engine_config(args, REPO, variant)
        cfg.validate()
        kernels.validate()
        assert kernels == dataclasses.replace(base_kernels, **kernel_fields), variant
        assert cfg == dataclasses.replace(base, **engine_fields), variant
    no_pdl, no_pdl_kernels = bench_throughput.engine_config(args, REPO, "no-pdl")
    assert no_pdl.pdl is False and no_pdl_kernels.decode_gemv == "auto"
    assert bench_throughput.engine_config(args, REPO, "no-graph")[0].cuda_graph_max_bs == 0
    assert bench_throughput.engine_config(args, REPO, "dummy-uniform")[0].dummy_init == "uniform"
    assert set(bench_throughput.ALL_VARIANTS) == {*bench_throughput.VARIANTS, "hf"}


def test_int4_variants_load_awq_dummy_weights(tmp_path):
    """int4-awq and int4-awq-dequant run the model's shapes with a config.json that adds AWQ's
    quantization_config (dummy INT4 weights); every other variant the model's own."""
    import bench_throughput
    import benchlib

    model_dir = benchlib.write_model_dir("tiny", tmp_path)
    assert bench_throughput.variant_model_dir(model_dir, "batchrun") == model_dir
    for variant in ("int4-awq", "int4-awq-dequant"):
        path = bench_throughput.variant_model_dir(model_dir, variant)
        config = json.loads((path / "config.json").read_text())
        assert config["quantization_config"] == benchlib.CHECKPOINT_FORMATS["awq"]
        assert config["hidden_size"] == benchlib.MODELS["tiny"]["hidden_size"]


def test_kv_fp8_variant_gets_the_same_bytes(tmp_path):
    """--kv-budget-same-bytes: the kv-fp8 variant's pool holds --kv-budget tokens' bytes of the
    compute dtype (fp32 on the CPU: 4x the tokens); the plain variant --kv-budget tokens."""
    run_script(
        "bench_throughput.py", "--device", "cpu", "--models", "tiny", "--workloads", "W3",
        "--variants", "batchrun,kv-fp8", "--kv-budget", "1024", "--kv-budget-same-bytes",
        "--warmup-requests", "2", "--out", str(tmp_path),
    )  # fmt: skip
    results = json.loads((tmp_path / "bench_throughput.json").read_text())["results"]
    slots = {r["variant"]: r["kv_slots"] for r in results}
    assert slots == {"batchrun": 1024, "kv-fp8": 4096}
    assert all(r["status"] == "ok" for r in results)


def test_kernel_option_takes_kernel_config_fields_only():
    import bench_throughput

    for bad in ("bogus=1", "pdl=maybe", "decode_norms"):
        with pytest.raises(SystemExit):
            bench_throughput.parse_args(["--kernel", bad])
    with pytest.raises(SystemExit):
        bench_throughput.parse_args(["--variants", "batchrun,gemv-peel-1"])


def test_scripts_select_variants_through_the_config_only():
    """No script reads or sets an environment switch: benchlib alone reads the environment, for
    $OUT (where a device run's figures come back), BATCHRUN_COMMIT and git's scratch index."""
    for path in sorted(SCRIPTS.glob("*.py")):
        for line in path.read_text().splitlines():
            if "os.environ" in line or "BATCHRUN_" in line:
                assert path.name == "benchlib.py", (path.name, line)
                assert re.search(r"\bOUT\b|BATCHRUN_COMMIT|GIT_INDEX_FILE", line), line


# -- the other engine benchmarks -------------------------------------------------------------


def test_bench_structured_cpu_smoke(tmp_path):
    pytest.importorskip("xgrammar")
    run_script(
        "bench_structured.py", "--device", "cpu", "--model", "tiny", "--num-prompts", "8",
        "--prompt-len", "16", "--output-len", "16", "--repeats", "1", "--phases",
        "--out", str(tmp_path),
    )  # fmt: skip
    report = json.loads((tmp_path / "bench_structured.json").read_text())
    assert report["free_tok_s"] > 0 and report["json_schema_tok_s"] > 0
    assert report["kernels"] == CPU_KERNELS
    run = report["runs"][f"json_schema {report['fill_settings'][0]}"][0]
    phases = run["phases_ms_per_step"]
    assert phases["fill_wait"] >= 0 and "accept_ms_per_step" in run
    assert phases["run_forward"] > 0 and phases["sample"] > 0  # the runner's internals, timed
    assert run["gated_steps"] == 0  # no host gate on the CPU


def test_bench_tp_cpu_smoke(tmp_path):
    out = run_script(
        "bench_tp.py", "--device", "cpu", "--models", "tiny", "--output-len", "8",
        "--repeats", "1", "--tp-sizes", "1,2", "--out", str(tmp_path),
    )  # fmt: skip
    table = (tmp_path / "bench_tp.md").read_text()
    assert "| tiny | 1 |" in table and "(reference)" in table and "| tiny | 2 |" in table
    assert "- tiny TP=2: attention=torch" in table and "error" not in out


def test_bench_dp_cpu_smoke():
    out = run_script(
        "bench_dp.py", "--device", "cpu", "--model", "tiny", "--workload", "W3", "--dp", "1",
        "--warmup", "1",
    )  # fmt: skip
    assert "| 1 |" in out and "1.00x" in out and "kernels (resolved): attention=torch" in out


def test_profile_decode_cpu_smoke():
    out = run_script(
        "profile_decode.py", "--device", "cpu", "--model", "tiny", "--batch", "2",
        "--warmup-steps", "2", "--steps", "2", "--context", "16",
    )  # fmt: skip
    assert "kernels: attention=torch" in out and "tiny batch 2 context 16" in out


def test_profile_decode_checkpoint_format_cpu_smoke():
    """--checkpoint-format awq: the step of dummy INT4 weights in AWQ's layout."""
    out = run_script(
        "profile_decode.py", "--device", "cpu", "--model", "tiny", "--batch", "1",
        "--warmup-steps", "2", "--steps", "2", "--context", "16", "--checkpoint-format", "awq",
    )  # fmt: skip
    assert "tiny batch 1 context 16" in out


def test_profile_decode_long_document_workload_cpu_smoke():
    """--workload W5 profiles on the 128k-context model (a 16,384-token prompt fits), warmed up
    on other prompts of the same lengths."""
    out = run_script(
        "profile_decode.py", "--device", "cpu", "--model", "tiny", "--workload", "W5",
        "--scale", "0.004",
    )  # fmt: skip
    assert "tiny W5 (1 x 16,384 in, 128 out)" in out


def test_bench_scheduler_cpu_smoke():
    out = run_script(
        "bench_scheduler.py", "--num-requests", "20", "--prompt-len", "32", "--output-len", "8",
        "--max-running", "8", "--chunk", "64", "--repeats", "1", "--digest",
    )  # fmt: skip
    assert "20 requests x 32 in, 8 out" in out and re.search(r"digest [0-9a-f]{16}", out)


def test_bench_order_json():
    out = run_script("bench_order.py", "--num", "2000", "--groups", "20", "--json")
    result = json.loads(out.strip().splitlines()[-1])
    assert result["num_prompts"] == 2000 and 280 <= result["mean_len"] <= 320
    assert 0 < result["reusable_fraction"] < 1


@pytest.mark.parametrize("strings", [False, True])
def test_bench_duplicate_ids_json(strings):
    extra = ("--strings",) if strings else ("--openai-rows", "300")
    out = run_script(
        "bench_duplicate_ids.py", "--num", "50000", "--hash-sample", "1000", "--json", *extra
    )
    result = json.loads(out.strip().splitlines()[-1])
    assert result["num_ids"] == 50000 and result["duplicates_found"] == 5
    assert result["load"] <= 0.75 and result["table_gib"] > 0
    assert strings or result["openai_pass_us_per_row"] > 0


def test_make_examples_parquet_is_current():
    pytest.importorskip("pyarrow")
    assert "matches" in run_script("make_examples.py", "--check")


def test_bench_cpu_engine_vs_hf_cpu_smoke():
    """Two prompts, four tokens, one run a side on the embedded model."""
    out = run_script(
        "bench_cpu_engine_vs_hf.py", "--num-prompts", "2", "--new-tokens", "4", "--repeats", "1",
        "--hf-batch-size", "2",
    )  # fmt: skip
    assert "| engine tok/s | HF tok/s |" in out and "identical greedy outputs 2/2" in out


def test_bench_cpu_engine_vs_hf_prompts_are_distinct():
    """Its prompts: the example conversations, numbered beyond them so that no two match (a
    whole run on the embedded model takes minutes on two cores: its command is the test)."""
    from bench_cpu_engine_vs_hf import load_conversations

    convs = load_conversations(80)
    assert len(convs) == 80
    assert len({json.dumps(c) for c in convs}) == 80


# -- GPU-only scripts --------------------------------------------------------------------------


# script -> its arguments for a run that needs no GPU to start (--out in a temporary directory)
GPU_SCRIPTS = {
    "bench_gemv.py": ("--out", "{tmp}"),
    "bench_attention_kernels.py": (),
    "bench_decode_attention_fp8.py": (),
    "bench_fp8_gemv.py": ("--out", "{tmp}"),
    "bench_fp8_matmul.py": ("--out", "{tmp}"),
    "bench_fused_moe.py": ("--out", "{tmp}"),
}


@pytest.mark.parametrize("name", sorted(GPU_SCRIPTS))
def test_gpu_script_help(name):
    """Each GPU micro-benchmark parses its options and imports its kernels on the CPU."""
    pytest.importorskip("triton")
    assert "usage: " + name in run_script(name, "--help")


@pytest.mark.parametrize("name", sorted(GPU_SCRIPTS))
def test_gpu_script_exits_cleanly_without_cuda(name, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: tests/gpu runs these")
    pytest.importorskip("triton")
    args = [a.format(tmp=tmp_path) for a in GPU_SCRIPTS[name]]
    assert f"{name.removesuffix('.py')}: needs " in run_script(name, *args)


def test_every_script_is_smoke_tested():
    """A script in scripts/ is run by a test of this file (or is a helper they import)."""
    helpers = {"benchlib.py", "host_phases.py", "triton_compiles.py", "step_trace.py"}
    others = {  # script -> the test that runs it elsewhere
        "check_kernels_compile.py": "tests/unit/test_kernels_compile.py",
        "bench_pooling.py": "tests/e2e/test_bench_pooling.py",
        "bench_serve.py": "tests/e2e/test_serve_bench.py",
        "readme_sample.py": "tests/e2e/test_readme_sample.py",
    }
    text = Path(__file__).read_text()
    for path in sorted(SCRIPTS.glob("*.py")):
        if path.name in helpers:
            continue
        if path.name in others:
            assert path.name in (REPO / others[path.name]).read_text(), path.name
            continue
        assert f'"{path.name}"' in text, f"scripts/{path.name} has no smoke test here"


# -- benchlib ----------------------------------------------------------------------------------


def test_model_shapes():
    """bench_gemv's matrices are the models' linear layers; the parameter counts follow."""
    one_b = {name: (n, k, count) for name, n, k, count in benchlib.linear_shapes("llama-1b")}
    assert one_b["qkv"] == (3072, 2048, 16) and one_b["down"] == (2048, 8192, 16)
    assert one_b["lm_head"] == (128256, 2048, 1)
    eight_b = {name: (n, k) for name, n, k, _ in benchlib.linear_shapes("llama-8b")}
    assert eight_b["gate_up"] == (28672, 4096) and eight_b["o"] == (4096, 4096)
    assert benchlib.num_params("llama-8b") == 8_030_261_248  # Llama-3.1-8B's count
    assert benchlib.num_params("llama-1b") == 1_235_814_400  # Llama-3.2-1B's


def test_workloads_keep_their_lengths_at_any_scale():
    w1, w2 = benchlib.make_workload("W1", 0.01), benchlib.make_workload("W2", 0.1)
    assert len(w1.prompts) == 20 and {len(p) for p in w1.prompts} == {512}
    assert len(w2.prompts) == 3 * 32 and {len(p) for p in w2.prompts} == {1024 + 128}
    assert len({tuple(p[:1024]) for p in w2.prompts}) == 3  # three shared prefixes
    assert benchlib.make_workload("W1", 0.01).prompts == w1.prompts  # seeded
    tiles = benchlib.expert_tile_tokens(1024)  # the experts' tile buckets, top and below
    assert tiles[:5] == [1, 2, 3, 4, 7] and tiles[-4:] == [767, 768, 1023, 1024]
    warm = benchlib.warmup_prompts(w1, 4)  # the same lengths, other tokens
    assert [len(p) for p in warm] == [512] * 4
    assert not {tuple(p) for p in warm} & {tuple(p) for p in w1.prompts}


def test_long_document_workloads(tmp_path):
    w5, w6 = benchlib.make_workload("W5", 0.01), benchlib.make_workload("W6", 0.0625)
    assert len(w5.prompts) == 3 and {len(p) for p in w5.prompts} == {16384}
    assert w5.output_len == 128
    assert len(w6.prompts) == 1 and w6.output_len == 64
    # their models: Llama 3.1's 128k context, which W6's prompt and its output fill (an engine
    # refuses a prompt that leaves no room for its output)
    path = benchlib.write_model_dir("llama-8b", tmp_path, long_context=True)
    config = json.loads((path / "config.json").read_text())
    assert config["max_position_embeddings"] == 131072 == len(w6.prompts[0]) + w6.output_len
    assert config["rope_scaling"]["rope_type"] == "llama3"


def test_prefill_flops_count_linears_lm_head_and_causal_attention():
    c = benchlib.MODELS["llama-8b"]
    matmuls = sum(n * k * count for m, n, k, count in benchlib.linear_shapes("llama-8b")
                  if m != "lm_head")  # fmt: skip
    lm_head = 2 * c["vocab_size"] * c["hidden_size"]
    # a 2-token prompt: 3 visible query-key pairs a head and layer, 2 x 2 x 128 flops each
    attention = 3 * 4 * 128 * 32 * 32
    assert benchlib.prefill_flops("llama-8b", [2]) == 2 * matmuls * 2 + lm_head + attention
    # a 128k prompt on llama-8b: 1.83 PFLOP of linears, 4.50 of attention
    assert benchlib.prefill_flops("llama-8b", [131072]) == pytest.approx(6.33e15, rel=0.01)


def test_source_tree_names_the_commit_or_the_dirty_tree(tmp_path):
    """A clean checkout is its short HEAD; one with changes (edited and untracked files) is
    "HEAD+dirty (tree T)" with T the tree its commit will have, hashed in a scratch index that
    leaves the repository's own untouched."""

    def git(*args):
        return subprocess.check_output(["git", *args], cwd=tmp_path, text=True).strip()

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / "a.py").write_text("one\n")
    git("add", "a.py")
    git("commit", "-qm", "one")
    assert benchlib.git_commit(tmp_path) == git("rev-parse", "--short", "HEAD")
    (tmp_path / "a.py").write_text("two\n")
    (tmp_path / "b.py").write_text("new\n")
    got = benchlib.git_commit(tmp_path)
    assert got.startswith(git("rev-parse", "--short", "HEAD") + "+dirty (tree ")
    assert "?? b.py" in git("status", "--porcelain")  # the real index is untouched
    git("add", "-A")
    git("commit", "-qm", "two")
    assert got.endswith(f"(tree {git('log', '-1', '--format=%T')[:10]})")


# -- instrumentation ---------------------------------------------------------------------------


def test_host_phases_find_every_target(tmp_path):
    """Every phase host_phases times is a method of the engine's objects: on the CPU all but
    those of CUDA graphs and of a grammar backend not made yet are found and count calls, and
    those exist on their classes; close() takes every timer off."""
    from batchrun.attention.triton_backend import TritonAttentionBackend
    from batchrun.engine.cuda_graph import CudaGraphRunner
    from batchrun.engine.grammar import GrammarBackend
    from batchrun.engine.piecewise_graph import PiecewiseGraphRunner

    engine = tiny_engine(tmp_path)
    phases = HostPhases(engine)
    elsewhere = {
        "graph_replay": (CudaGraphRunner, "replay"),
        "graph_inputs": (TritonAttentionBackend, "load_graph_inputs"),
        "piecewise_forward": (PiecewiseGraphRunner, "run"),
        "mask_apply": (GrammarBackend, "apply"),
    }
    assert set(phases.labels) == {label for label, _, _ in PHASES} - set(elsewhere)
    for cls, name in elsewhere.values():
        assert callable(getattr(cls, name))
    prompts = benchlib.make_workload("W1", 0.001).prompts
    benchlib.run_engine_once(engine, prompts, 4, benchlib.Device("cpu"), None)
    for label in ("schedule", "launch", "stage", "run_forward", "eager_forward", "sample"):
        assert phases.calls[label] >= 4, label
    took = phases.take(1.0, engine.stats.num_steps)
    assert took["run_forward"] > 0 and "occupancy" in took
    phases.close()
    assert not {"_run_forward", "_stage", "_sample", "wait"} & set(vars(engine.runner))


def test_method_timers_on_a_class_time_every_instance_and_restore_it():
    """host_phases times Triton's launches with a timer on JITFunction itself; close() must put
    the class's own method back, and an instance's timer must leave its class alone."""

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


def test_latency_probe_sees_each_first_token(tmp_path):
    """The probe on the engine's result processing: one first-token time per request, between
    the run's start and its end."""
    engine = tiny_engine(tmp_path)
    probe = benchlib.LatencyProbe(engine)
    assert probe.active
    prompts = benchlib.make_workload("W1", 0.002).prompts
    wall, bad, done, ttfts, itls = benchlib.run_engine_once(
        engine, prompts, 3, benchlib.Device("cpu"), probe
    )
    assert (bad, done) == (0, 4) and len(probe.first) == 4
    assert len(ttfts) == len(itls) == 4 and all(0 < t <= wall for t in ttfts)


def test_compile_log_phases_and_hooks():
    """The variants Triton builds, by phase (fed by hand here: the CPU has no compiler), and
    its hooks in Triton's runtime knobs put back on close."""

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
