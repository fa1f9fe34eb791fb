"""The GPU runtime gives the same greedy tokens whichever way it runs: CUDA graphs or eager,
overlap on or off, Triton or torch attention, and equals HF transformers in fp32."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

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


def _run(model_dir: str, **kw) -> dict[str, list[int]]:
    from batchrun.config import EngineConfig
    from batchrun.engine.engine import Engine

    cfg = dict(model=model_dir, device="cuda", dtype="float32", kv_budget=20000)
    engine = Engine(EngineConfig(**{**cfg, **kw}))
    out = {r.rid: r.output_ids for r in engine.generate(_requests(40, 48))}
    engine.check_integrity()
    return out


@pytest.fixture(scope="module")
def reference(model_dir):
    return _run(model_dir, attention_backend="torch", overlap=False, cuda_graph_max_bs=0)


@pytest.mark.parametrize(
    "kw",
    [
        dict(attention_backend="triton", overlap=False, cuda_graph_max_bs=0),
        dict(attention_backend="triton", overlap=True, cuda_graph_max_bs=0),
        dict(attention_backend="triton", overlap=False, cuda_graph_max_bs=64),
        dict(attention_backend="triton", overlap=True, cuda_graph_max_bs=64),
        dict(
            attention_backend="triton",
            overlap=True,
            cuda_graph_max_bs=64,
            kv_budget=1200,
            new_token_ratio=0.05,
        ),
        dict(attention_backend="torch", overlap=True, cuda_graph_max_bs=0),
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
def test_same_greedy_tokens(model_dir, reference, kw):
    assert _run(model_dir, **kw) == reference


@pytest.mark.parametrize("one_kernel", [True, False], ids=["one-kernel", "copies"])
def test_decode_graph_inputs_in_one_kernel_or_by_copies(
    model_dir, reference, monkeypatch, one_kernel
):
    """The decode graphs' inputs, placeholder ids included (overlap), loaded by
    kernels/graph_inputs.py (the default with the Triton backend, for batches up to
    GRAPH_INPUTS_MAX_BS: the tail of this run) or by the copies (BATCHRUN_GRAPH_INPUTS=0): the
    same tokens; the kernel ran where it was on."""
    import batchrun.kernels.graph_inputs as graph_inputs
    from spies import count_calls

    from batchrun.engine.cuda_graph import GRAPH_INPUTS_ENV

    if not one_kernel:
        monkeypatch.setenv(GRAPH_INPUTS_ENV, "0")
    calls = count_calls(monkeypatch, graph_inputs, "load_decode_graph_inputs")
    kw = dict(attention_backend="triton", overlap=True, cuda_graph_max_bs=64, kv_budget=1200)
    assert _run(model_dir, new_token_ratio=0.05, **kw) == reference
    assert (calls["n"] > 0) == one_kernel


@pytest.mark.parametrize(
    "kw",
    [
        dict(attention_backend="triton", overlap=False),
        dict(attention_backend="triton", overlap=True, chunked_prefill_size=300),
        dict(attention_backend="triton", overlap=True, cuda_graph_max_bs=16),
        dict(attention_backend="triton", overlap=True, kv_budget=1200, new_token_ratio=0.05),
        dict(attention_backend="torch", overlap=True),
    ],
    ids=["eager-loop", "overlap-small-chunks", "decode-graphs", "retract", "torch"],
)
def test_piecewise_graphs_give_the_same_tokens(model_dir, reference, monkeypatch, kw):
    """Prefill and mixed steps (and decodes past the decode graphs) replay piecewise graphs
    around an eager attention (engine/piecewise_graph.py): the tokens do not change. Small
    chunks make many mixed steps of odd sizes, padded up to a captured size. (FlashInfer, which
    needs head dim 64+ and bf16, runs them in test_flashinfer_backend.py's graph-overlap case.)"""
    from spies import count_calls

    from batchrun.engine.piecewise_graph import PiecewiseGraphRunner

    kw = {"cuda_graph_max_bs": 0, **kw}
    calls = count_calls(monkeypatch, PiecewiseGraphRunner, "run")
    assert _run(model_dir, piecewise_cuda_graph=True, **kw) == reference
    assert calls["n"] > 0


def test_piecewise_graphs_default_on_small_models_only(model_dir):
    """On by default for a small model with decode graphs on; off without them, or when asked."""
    from batchrun.config import CHUNKED_PREFILL, MAX_RUNNING_CUDA, EngineConfig
    from batchrun.engine.engine import Engine

    base = dict(model=model_dir, device="cuda", dtype="float32", kv_budget=2000)
    for kw, want in (
        (dict(cuda_graph_max_bs=8), True),
        (dict(cuda_graph_max_bs=0), False),
        (dict(cuda_graph_max_bs=8, piecewise_cuda_graph=False), False),
        (dict(cuda_graph_max_bs=8, chunked_prefill_size=None), False),
    ):
        engine = Engine(EngineConfig(**base, **kw))
        assert (engine.runner.piecewise is not None) == want, kw
        if want:  # the default chunk + max_running (4,096 + 512 on CUDA), in steps of 256
            assert engine.runner.piecewise.max_tokens == CHUNKED_PREFILL + MAX_RUNNING_CUDA == 4608
        del engine
        torch.cuda.empty_cache()


def test_matches_hf_on_cuda(model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    ours = _run(model_dir, attention_backend="triton", overlap=True, cuda_graph_max_bs=64)
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
def test_dummy_weights_drawn_on_the_device(model_dir, monkeypatch, kind):
    """load_format="dummy" draws on the GPU: normal(0, 0.02) with the norms at 1, or with
    BATCHRUN_DUMMY_INIT=uniform every parameter in U(-1e-3, 1e-3); seeded, so equal twice."""
    from batchrun.config import EngineConfig
    from batchrun.engine.engine import Engine
    from batchrun.models.layers import DUMMY_INIT_ENV, UNIFORM_DUMMY_BOUND

    monkeypatch.setenv(DUMMY_INIT_ENV, kind)
    cfg = EngineConfig(model=model_dir, device="cuda", load_format="dummy", kv_budget=2000)
    first = {n: p.detach().clone() for n, p in Engine(cfg).runner.model.named_parameters()}
    again = dict(Engine(cfg).runner.model.named_parameters())
    for name, p in first.items():
        assert p.is_cuda and torch.equal(p, again[name]), name
        if kind == "uniform":
            assert p.abs().max() <= UNIFORM_DUMMY_BOUND and p.float().std() > 2e-4, name
        elif name.endswith("norm.weight"):
            assert bool((p == 1).all()), name
        else:
            assert 0.015 < p.float().std() < 0.025, name
