"""The GPU runtime gives the same greedy tokens whichever way it runs: CUDA graphs or eager,
overlap on or off, Triton or torch attention, and equals HF transformers in fp32. Also: the
kernel config an engine resolves on this GPU, and CUDA graph captures that no garbage collection
can break."""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch

from batchrun.config import EngineConfig, KernelPlan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_models import make_tiny_model

    path = tmp_path_factory.mktemp("llama-gpu")
    make_tiny_model("llama", path)
    return str(path)


def _requests(num: int, new: int):
    from tiny_models import random_prompts

    from batchrun.params import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(num, seed=11, min_len=4, max_len=120)
    # a shared prefix for half of them, so the radix cache and extend-over-prefix run too
    shared = prompts[0][:30]
    prompts = [shared + p if i % 2 else p for i, p in enumerate(prompts)]
    return [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]


def _config(model_dir: str, kernels: dict, **kw) -> tuple[EngineConfig, KernelPlan]:
    """An fp32 engine config on CUDA (kw: other EngineConfig fields) and the plan fields
    KernelPlan(**kernels): Engine(*_config(...))."""
    cfg = dict(model=model_dir, device="cuda", dtype="float32", kv_budget=20000)
    return EngineConfig(**{**cfg, **kw}), KernelPlan(**kernels)


def _generate(engine, num: int = 40, new: int = 48) -> dict[str, list[int]]:
    out = {r.rid: r.output_ids for r in engine.generate(_requests(num, new))}
    engine.check_integrity()
    return out


def _run(model_dir: str, kernels: dict, **kw) -> dict[str, list[int]]:
    from batchrun.engine.engine import Engine

    return _generate(Engine(*_config(model_dir, kernels, **kw)))


@pytest.fixture(scope="module")
def reference(model_dir):
    return _run(model_dir, dict(attention="torch", cuda_graph_max_bs=0), overlap=False)


@pytest.mark.parametrize(
    "kernels,kw",
    [
        (dict(attention="triton", cuda_graph_max_bs=0), dict(overlap=False)),
        (dict(attention="triton", cuda_graph_max_bs=0), dict(overlap=True)),
        (dict(attention="triton", cuda_graph_max_bs=64), dict(overlap=False)),
        (dict(attention="triton", cuda_graph_max_bs=64), dict(overlap=True)),
        (
            dict(attention="triton", cuda_graph_max_bs=64),
            dict(overlap=True, kv_budget=1200, new_token_ratio=0.05),
        ),
        (dict(attention="torch", cuda_graph_max_bs=0), dict(overlap=True)),
    ],
    ids=[
        "triton-eager",
        "triton-overlap",
        "triton-graph",
        "triton-graph-overlap",
        "triton-graph-overlap-retract",
        "torch-overlap",
    ],
)
def test_same_greedy_tokens(model_dir, reference, kernels, kw):
    assert _run(model_dir, kernels, **kw) == reference


@pytest.mark.parametrize("one_kernel", [True, False], ids=["one-kernel", "copies"])
def test_decode_graph_inputs_in_one_kernel_or_by_copies(
    model_dir, reference, monkeypatch, one_kernel
):
    """The decode graphs' inputs, placeholder ids included (overlap), loaded by
    kernels/graph_inputs.py (with the Triton kernels on, for batches up to GRAPH_INPUTS_MAX_BS:
    the tail of this run; larger batches take the copies) or, for a graph runner built without
    the token pool, by the copies alone: the same tokens; the kernel runs only where it serves."""
    import batchrun.engine.cuda_graph as cuda_graph

    sizes = []  # the batch size of each input-kernel call (the first: its compile at start-up)
    real_kernel = cuda_graph.load_decode_graph_inputs

    def input_kernel(src, dst, token_pool, n, bs, pad_row, pad_slot):
        sizes.append(n)
        return real_kernel(src, dst, token_pool, n, bs, pad_row, pad_slot)

    monkeypatch.setattr(cuda_graph, "load_decode_graph_inputs", input_kernel)
    if not one_kernel:
        real_init = cuda_graph.CudaGraphRunner.__init__

        def init_with_copies(self, *args, **kwargs):
            kwargs["token_pool"] = None
            real_init(self, *args, **kwargs)

        monkeypatch.setattr(cuda_graph.CudaGraphRunner, "__init__", init_with_copies)
    kernels = dict(attention="triton", cuda_graph_max_bs=64)
    tokens = _run(model_dir, kernels, overlap=True, kv_budget=1200, new_token_ratio=0.05)
    assert tokens == reference
    if one_kernel:
        assert len(sizes) > 1, "the input kernel served no replay"
        assert max(sizes) <= cuda_graph.GRAPH_INPUTS_MAX_BS, sizes
    else:
        assert sizes == []


@pytest.mark.parametrize(
    "kernels,kw",
    [
        (dict(attention="triton"), dict(overlap=False)),
        (dict(attention="triton"), dict(overlap=True, chunked_prefill_size=300)),
        (dict(attention="triton", cuda_graph_max_bs=16), dict(overlap=True)),
        (dict(attention="triton"), dict(overlap=True, kv_budget=1200, new_token_ratio=0.05)),
        (dict(attention="torch"), dict(overlap=True)),
    ],
    ids=["eager-loop", "overlap-small-chunks", "decode-graphs", "retract", "torch"],
)
def test_piecewise_graphs_give_the_same_tokens(model_dir, reference, monkeypatch, kernels, kw):
    """Prefill and mixed steps (and decodes past the decode graphs) replay piecewise graphs
    around an eager attention (engine/piecewise_graph.py): the tokens do not change. Small
    chunks make many mixed steps of odd sizes, padded up to a captured size. (FlashInfer's FA3
    prefill, which needs head dim 64+ and bf16, runs them in test_fa3_prefill.py's graph-overlap
    case.)"""
    from spies import count_calls

    from batchrun.engine.piecewise_graph import PiecewiseGraphRunner

    kernels = {"cuda_graph_max_bs": 0, **kernels, "piecewise_graphs": True}
    calls = count_calls(monkeypatch, PiecewiseGraphRunner, "run")
    assert _run(model_dir, kernels, **kw) == reference
    assert calls["n"] > 0


def test_piecewise_graphs_default_on_small_models_only(model_dir):
    """On by default for a small model with decode graphs on; off without them, or when asked."""
    from batchrun.config import CHUNKED_PREFILL, MAX_RUNNING_CUDA
    from batchrun.engine.engine import Engine

    base = dict(model=model_dir, device="cuda", dtype="float32", kv_budget=2000)
    for kernels, kw, want in (
        (dict(cuda_graph_max_bs=8), {}, True),
        (dict(cuda_graph_max_bs=0), {}, False),
        (dict(cuda_graph_max_bs=8, piecewise_graphs=False), {}, False),
        (dict(cuda_graph_max_bs=8), dict(chunked_prefill_size=None), False),
    ):
        engine = Engine(EngineConfig(**base, **kw), kernels=KernelPlan(**kernels))
        assert (engine.runner.piecewise is not None) == want, (kernels, kw)
        assert engine.kernels.piecewise_graphs == want, (kernels, kw)
        if want:  # the default chunk + max_running (4,096 + 512 on CUDA), in steps of 256
            assert engine.runner.piecewise.max_tokens == CHUNKED_PREFILL + MAX_RUNNING_CUDA == 4608
        del engine
        gc.collect()
        torch.cuda.empty_cache()


def test_matches_hf_on_cuda(model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    ours = _run(model_dir, dict(attention="triton", cuda_graph_max_bs=64), overlap=True)
    for req in _requests(6, 48):
        ids = torch.tensor([req.input_ids], device="cuda")
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=48,
            min_new_tokens=48,
            do_sample=False,
            pad_token_id=0,
        )
        assert ours[req.rid] == out[0, ids.shape[1] :].tolist(), req.rid


@pytest.mark.parametrize("kind", ["normal", "uniform"])
def test_dummy_weights_drawn_on_the_device(model_dir, kind):
    """load_format="dummy" draws on the GPU: normal(0, 0.02) with the norms at 1, or with
    dummy_init="uniform" every parameter in U(-1e-3, 1e-3); seeded, so equal twice. The first
    engine is dropped (with its CUDA graphs) before the second one captures its own."""
    from batchrun.engine.engine import Engine
    from batchrun.models.dummy import UNIFORM_DUMMY_BOUND

    cfg = EngineConfig(
        model=model_dir, device="cuda", load_format="dummy", dummy_init=kind, kv_budget=2000
    )
    first = {n: p.detach().clone() for n, p in Engine(cfg).runner.model.named_parameters()}
    again = dict(Engine(cfg).runner.model.named_parameters())
    for name, p in first.items():
        assert p.is_cuda and torch.equal(p, again[name]), name
        if kind == "uniform":
            bound = UNIFORM_DUMMY_BOUND * (1 + 2**-8)  # drawn in float32, rounded to bf16
            assert p.abs().max() <= bound and p.float().std() > 2e-4, name
        elif name.endswith("norm.weight"):
            assert bool((p == 1).all()), name
        else:
            assert 0.015 < p.float().std() < 0.025, name


def test_the_kernel_config_resolved_on_this_gpu(model_dir):
    """An engine on CUDA left at the defaults runs what an H200 should: the Triton attention and
    small kernels, PDL (sm_90+), every decode matmul of up to 16 rows on kernels/gemv.py with
    the norms inside the matmuls before them (a model of hidden size <= 2048), decode and
    piecewise graphs, and the host gate (overlap is on by default on CUDA)."""
    from batchrun.engine.engine import Engine

    engine = Engine(EngineConfig(model=model_dir, device="cuda", kv_budget=2000))
    kernels = engine.kernels
    assert kernels.is_resolved, kernels.describe()
    assert kernels == engine.runner.kernels
    assert kernels.attention == "triton"
    assert kernels.triton_ops is True
    if torch.cuda.get_device_capability()[0] >= 9:
        assert kernels.pdl is True
        assert kernels.decode_gemv == "triton"
        assert kernels.decode_norms == "all"  # the tiny model's hidden size is 64
    else:  # without PDL cuBLAS reads faster (kernel_choice.py)
        assert kernels.pdl is False
        assert kernels.decode_gemv == "cublas" and kernels.decode_norms == "off"
    assert kernels.cuda_graph_max_bs == 512 and engine.runner.graphs is not None
    assert kernels.piecewise_graphs is True and engine.runner.piecewise is not None
    assert engine.overlap is True
    assert kernels.host_gate is True and engine.gate is not None


# ---- CUDA graph captures and the garbage collector ---------------------------------------------


def _held_only_by_a_cycle(keep: list) -> tuple[weakref.ref, list]:
    """(ref, died) for the engine keep[0], the list's only element: `ref` is a weak reference to
    it, and `died` gets, when the engine is freed, whether a CUDA graph capture was in progress
    then. Asserts that once `keep` lets go of the engine a reference cycle keeps it alive (only
    the cyclic collector can free it); `keep` holds it again on return."""
    died = []
    ref = weakref.ref(keep[0], lambda _: died.append(torch.cuda.is_current_stream_capturing()))
    enabled = gc.isenabled()
    gc.disable()
    try:
        keep.clear()
        assert ref() is not None, "no reference cycle holds the engine: this test needs one"
        keep.append(ref())
    finally:
        if enabled:
            gc.enable()
    return ref, died


def _garbage_when_capturing(monkeypatch, owner, name: str, keep: list) -> None:
    """Wrap owner.name so that its first call inside a CUDA graph capture clears `keep` first:
    the engine there becomes garbage in the middle of another engine's capture."""
    real = getattr(owner, name)

    def wrapped(*args, **kwargs):
        if keep and torch.cuda.is_current_stream_capturing():
            keep.clear()
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)


def _collections_inside_captures() -> tuple[list, object]:
    """(inside, callback): gc.callbacks' `callback` appends to `inside`, for every collection
    that starts, whether a CUDA graph capture is in progress on this thread."""
    inside = []

    def callback(phase, info):
        if phase == "start":
            inside.append(torch.cuda.is_current_stream_capturing())

    return inside, callback


def _second_engine_captures_while_the_first_is_garbage(monkeypatch, config, owner, name):
    """Engine A (built from `config`), dropped into a reference cycle; engine B (the same config)
    captures its graphs while A becomes garbage (at the first owner.name call inside a capture),
    with the collector's thresholds at 1 so that an automatic collection would follow almost
    every allocation. B builds and gives A's greedy tokens; no collection starts inside a
    capture; after B is built, one collection frees A, outside any capture."""
    from batchrun.engine.engine import Engine

    keep = [Engine(*config)]
    want = _generate(keep[0], num=24, new=24)
    ref, died = _held_only_by_a_cycle(keep)
    gc.collect()
    assert ref() is not None
    _garbage_when_capturing(monkeypatch, owner, name, keep)
    inside, callback = _collections_inside_captures()
    enabled, threshold = gc.isenabled(), gc.get_threshold()
    gc.callbacks.append(callback)
    try:
        gc.enable()
        gc.set_threshold(1, 1, 1)
        second = Engine(*config)
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(*threshold)
        if not enabled:
            gc.disable()
    assert keep == [], "the capture never ran"
    assert inside and not any(inside), "a garbage collection started inside a graph capture"
    gc.collect()
    assert ref() is None, "the dropped engine is still alive"
    assert died == [False], "the dropped engine was freed inside a graph capture"
    assert _generate(second, num=24, new=24) == want


def test_a_dropped_engine_is_not_collected_inside_a_decode_capture(model_dir, monkeypatch):
    """A dropped Engine (which sits in reference cycles) keeps its CUDA graphs until the cyclic
    collector frees it. A collection that runs inside another engine's decode graph capture
    would destroy those graphs there, which invalidates the capture in progress (cuBLAS reports
    CUBLAS_STATUS_EXECUTION_FAILED inside F.linear, then cudaErrorStreamCaptureInvalidated).
    CudaGraphRunner._capture runs with the collector off (engine/gc_pause.py's no_gc); this
    test makes the dropped engine garbage at the capture's first forward, with collections due
    at almost every allocation, so that any collection inside the capture would show."""
    from batchrun.models.blocks.model import CausalLM

    kernels = dict(attention="triton", cuda_graph_max_bs=16, piecewise_graphs=False)
    config = _config(model_dir, kernels, kv_budget=2000, max_running=16)
    _second_engine_captures_while_the_first_is_garbage(monkeypatch, config, CausalLM, "forward")


def test_a_dropped_engine_is_not_collected_inside_a_piecewise_capture(model_dir, monkeypatch):
    """As the decode graph test, for engine/piecewise_graph.py's captures (also under no_gc):
    the dropped engine's piecewise graphs are not destroyed inside the next engine's capture."""
    from batchrun.engine.piecewise_graph import PiecewiseGraphRunner

    kernels = dict(attention="triton", cuda_graph_max_bs=0, piecewise_graphs=True)
    config = _config(model_dir, kernels, kv_budget=2000, max_running=16, chunked_prefill_size=256)
    _second_engine_captures_while_the_first_is_garbage(
        monkeypatch, config, PiecewiseGraphRunner, "_piece"
    )


@pytest.mark.parametrize("enabled", [True, False], ids=["gc-on", "gc-off"])
def test_graph_capture_pauses_the_collector_and_restores_it(model_dir, monkeypatch, enabled):
    """CudaGraphRunner._capture turns the collector off for its captures and leaves it as it
    found it: enabled afterwards if it was enabled before, disabled if it was disabled."""
    from spies import count_calls

    from batchrun.engine.cuda_graph import CudaGraphRunner
    from batchrun.engine.engine import Engine
    from batchrun.models.blocks.model import CausalLM

    during = []  # gc.isenabled() at each forward inside a capture
    real_forward = CausalLM.forward

    def forward(self, batch, backend):
        if torch.cuda.is_current_stream_capturing():
            during.append(gc.isenabled())
        return real_forward(self, batch, backend)

    monkeypatch.setattr(CausalLM, "forward", forward)
    captures = count_calls(monkeypatch, CudaGraphRunner, "_capture")
    was_enabled = gc.isenabled()
    try:
        if enabled:
            gc.enable()
        else:
            gc.disable()
        kernels = dict(attention="triton", cuda_graph_max_bs=8, piecewise_graphs=False)
        engine = Engine(*_config(model_dir, kernels, kv_budget=2000, max_running=8))
        assert gc.isenabled() == enabled
    finally:
        if was_enabled:
            gc.enable()
        else:
            gc.disable()
    assert captures["n"] == 1 and engine.runner.graphs is not None
    assert during and not any(during), during
