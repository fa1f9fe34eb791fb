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

    from batchrun.engine.params import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(num, seed=11, min_len=4, max_len=120)
    # a shared prefix for half of them, so the radix cache and extend-over-prefix run too
    shared = prompts[0][:30]
    prompts = [shared + p if i % 2 else p for i, p in enumerate(prompts)]
    return [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]


def _run(model_dir: str, **kw) -> dict[str, list[int]]:
    from batchrun.engine.config import EngineConfig
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


@pytest.mark.parametrize("graphs", [0, 64], ids=["eager", "graph"])
def test_l2_prefetch_gives_the_same_tokens(model_dir, reference, monkeypatch, graphs):
    """BATCHRUN_L2_PREFETCH_MB: each layer of a small decode batch prefetches o_proj and gate_up
    on a side stream, joined before the layer returns (captured as a fork in the graphs). The
    tokens do not change."""
    import batchrun.kernels.l2_prefetch as prefetch
    from spies import count_calls

    from batchrun.models.layers import L2_PREFETCH_ENV

    calls = count_calls(monkeypatch, prefetch, "l2_prefetch")
    monkeypatch.setenv(L2_PREFETCH_ENV, "0.05")  # cuts inside gate_up of the tiny model
    got = _run(model_dir, max_running=8, overlap=True, cuda_graph_max_bs=graphs)
    assert calls["n"] > 0
    assert got == reference


def test_l2_prefetch_kernel_reads_what_it_should():
    """The xor of what each program read equals the host's xor of the same words (bf16 weights,
    a cut inside the second tensor)."""
    from functools import reduce
    from operator import xor

    from batchrun.kernels.l2_prefetch import BLOCK, NUM_PROGRAMS, l2_prefetch, prefetch_words

    first = torch.randn(1000, 777, device="cuda", dtype=torch.bfloat16)
    second = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    max_bytes = first.numel() * 2 + 100 * BLOCK * 4 + 12
    sink = torch.zeros(2 * NUM_PROGRAMS, dtype=torch.int32, device="cuda")
    l2_prefetch([first, second], max_bytes, sink)
    for i, words in enumerate(prefetch_words([first, second], max_bytes)):
        programs = min(NUM_PROGRAMS, -(-words.numel() // BLOCK))
        got = reduce(xor, sink[i * NUM_PROGRAMS : i * NUM_PROGRAMS + programs].tolist(), 0)
        want = reduce(xor, words.cpu().tolist(), 0)
        assert got == want, i
