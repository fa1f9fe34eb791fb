"""engine/piecewise_graph.py without CUDA: on the CPU its pieces run eagerly, through the same
static buffers, padding and attention `out=` path that the graphs use on the GPU, so the step
logic is checked here and the capture in tests/gpu."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def test_token_buckets():
    from batchrun.engine.piecewise_graph import token_buckets

    assert token_buckets(4352) == list(range(256, 4353, 256))
    assert token_buckets(300, 64) == [64, 128, 192, 256, 320]
    assert token_buckets(1, 64) == [64]
    assert token_buckets(600, small=True) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768]


def test_padding_to_a_graph_keeps_a_step_in_its_expert_tile_bucket():
    """A step padded to a captured size (decode graphs, or piecewise with experts) picks the expert
    tiles its eager run picks: kernels/fused_moe.py tile_tokens is the same for both."""
    pytest.importorskip("triton")
    import bisect

    from batchrun.kernels.fused_moe import tile_tokens, tokens_per_pass

    from batchrun.engine.cuda_graph import graph_batch_sizes
    from batchrun.engine.piecewise_graph import MAX_TOKENS, token_buckets

    def padded(sizes, t):
        return sizes[bisect.bisect_left(sizes, t)]

    for sizes in (
        graph_batch_sizes(512),
        graph_batch_sizes(100),
        graph_batch_sizes(300),
        token_buckets(MAX_TOKENS, small=True),
    ):
        for t in range(1, sizes[-1] + 1):
            assert tile_tokens(t) == tile_tokens(padded(sizes, t)), (sizes[-1], t)
    for top_k in (1, 2, 4, 6, 8):  # a step's last pass pads like the step
        assert tokens_per_pass(top_k) % 256 == 0


@pytest.fixture(scope="module", params=["llama", "gemma3", "qwen2_moe", "gpt_oss"])
def model_dir(request, tmp_path_factory):
    """gemma3: its scaled embeddings in the first piece, each layer's own rotary (the sliding
    layers' base) to the eager attention; qwen2_moe: experts (and a shared expert) inside the
    pieces, the padded rows routed with the rest; gpt_oss: each layer's sinks and window to the
    eager attention."""
    from tiny_models import make_tiny_model

    path = tmp_path_factory.mktemp(f"{request.param}-piecewise")
    make_tiny_model(request.param, path)
    return str(path)


def _generate(model_dir: str, piecewise_bucket: int | None, calls: dict | None = None):
    from tiny_models import random_prompts

    from batchrun.config import EngineConfig
    from batchrun.engine.engine import Engine
    from batchrun.engine.piecewise_graph import PiecewiseGraphRunner
    from batchrun.params import GenerateRequest, SamplingParams

    # small chunks and a small batch: many mixed steps of odd sizes
    cfg = EngineConfig(
        model=model_dir, device="cpu", dtype="float32", max_running=6, chunked_prefill_size=50
    )
    engine = Engine(cfg)
    runner = engine.runner
    assert runner.piecewise is None  # not on the CPU by itself
    if piecewise_bucket:
        runner.piecewise = PiecewiseGraphRunner(
            runner.model, runner.backend, 56, runner.device, bucket=piecewise_bucket
        )
        real = runner.piecewise.run

        def counted(*args):
            calls["n"] += 1
            return real(*args)

        runner.piecewise.run = counted
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(14, seed=5, min_len=3, max_len=70)
    prompts = [prompts[0][:20] + p if i % 3 == 0 else p for i, p in enumerate(prompts)]
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    out = {r.rid: r.output_ids for r in engine.generate(reqs)}
    engine.check_integrity()
    return out


def test_pieces_give_the_same_tokens_as_the_plain_forward(model_dir):
    """Prefill and mixed steps through the pieces (padded to 16-token sizes, the attention
    writing into the static buffer) give the tokens of the plain forward."""
    calls = {"n": 0}
    want = _generate(model_dir, None)
    assert _generate(model_dir, 16, calls) == want
    assert calls["n"] > 0
