"""A mixture of experts on the GPU: greedy tokens are the same with CUDA graphs (decode and
piecewise) or eager, overlap on or off, on the real models' widths (Qwen3-30B-A3B's and
Qwen1.5-MoE's layers, two of them, dummy weights in float32: in bf16, random weights' near-ties
flip where a retracted request's re-prefill recomputes in one GEMM shape what decode wrote in
another); the fused Triton MoE's logits in bf16 are the torch loop's within bf16's precision,
and a long prefill's on torch._grouped_mm (sm_90) theirs; a one-token decode with the norms
inside the GEMVs (decode_norms) gives the same tokens in graphs, and with PDL as without; and
the tiny models equal HF
transformers in fp32 with the experts on the torch loop."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from batchrun.config import EngineConfig, KernelPlan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NEW = 32


@pytest.fixture(scope="module", params=["qwen3-30b-a3b", "qwen1.5-moe"])
def dummy_dir(request, tmp_path_factory) -> str:
    from moe_configs import QWEN3_30B_A3B, QWEN15_MOE_A27B

    raw = QWEN3_30B_A3B if request.param == "qwen3-30b-a3b" else QWEN15_MOE_A27B
    path = tmp_path_factory.mktemp(request.param)
    (path / "config.json").write_text(json.dumps(dict(raw, num_hidden_layers=2)))
    return str(path)


def _requests(num: int = 24):
    from tiny_models import random_prompts

    from batchrun.params import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(num, seed=5, min_len=4, max_len=200)
    shared = prompts[0][:40]
    prompts = [shared + p if i % 2 else p for i, p in enumerate(prompts)]
    return [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]


def _engine(model_dir: str, kernels: dict, **kw):
    from batchrun.engine.engine import Engine

    cfg = dict(model=model_dir, load_format="dummy", device="cuda", dtype="bfloat16",
               kv_budget=20000, chunked_prefill_size=256)  # fmt: skip
    return Engine(EngineConfig(**{**cfg, **kw}), kernels=KernelPlan(**kernels))


def _generate(engine) -> dict[str, list[int]]:
    out = {r.rid: r.output_ids for r in engine.generate(_requests())}
    engine.check_integrity()
    return out


@pytest.fixture(scope="module")
def eager(dummy_dir):
    kernels = dict(moe="triton", cuda_graph_max_bs=0, piecewise_graphs=False)
    return _generate(_engine(dummy_dir, kernels, overlap=False, dtype="float32"))


@pytest.mark.parametrize(
    "kernels,kw",
    [
        (dict(moe="triton", cuda_graph_max_bs=0, piecewise_graphs=False), dict(overlap=True)),
        (dict(moe="triton", cuda_graph_max_bs=64, piecewise_graphs=False), dict(overlap=False)),
        (dict(moe="triton", cuda_graph_max_bs=64, piecewise_graphs=True), dict(overlap=False)),
        (
            dict(moe="triton", cuda_graph_max_bs=64),  # no piecewise graphs by default
            dict(overlap=True, kv_budget=1500, new_token_ratio=0.05),  # retraction
        ),
        (
            dict(moe="triton", cuda_graph_max_bs=64, piecewise_graphs=True),
            dict(overlap=True, kv_budget=1500, new_token_ratio=0.05),
        ),
    ],
)
def test_graphs_and_overlap_give_eager_tokens(dummy_dir, eager, kernels, kw):
    engine = _engine(dummy_dir, kernels, **kw, dtype="float32")
    assert engine.runner.kernels.moe == "triton"
    assert engine.kernels.piecewise_graphs is kernels.get("piecewise_graphs", False)
    assert _generate(engine) == eager


@pytest.mark.parametrize("num", [1, 2, 4])
def test_moe_gemv_decode_graphs_give_its_eager_tokens(dummy_dir, num):
    """moe_decode "gemv": decode batches of 1 to 4 requests (Qwen3's top-8 takes the GEMVs to 2,
    Qwen1.5-MoE's top-4 to 4) give the same tokens in decode graphs with overlap as eager, and
    its logits are the grouped GEMMs' within bf16's precision."""

    def tokens(**kernels):
        engine = _engine(dummy_dir, dict(moe="triton", moe_decode="gemv", **kernels),
                         dtype="float32", overlap=kernels["cuda_graph_max_bs"] > 0)  # fmt: skip
        assert engine.runner.kernels.moe_decode == "gemv"
        out = {r.rid: r.output_ids for r in engine.generate(_requests()[:num])}
        engine.check_integrity()
        return out

    eager = tokens(cuda_graph_max_bs=0, piecewise_graphs=False)
    assert tokens(cuda_graph_max_bs=64, piecewise_graphs=False) == eager
    gemv = _engine(dummy_dir, dict(moe="triton", moe_decode="gemv", cuda_graph_max_bs=0,
                                   piecewise_graphs=False))  # fmt: skip
    grouped = _engine(dummy_dir, dict(moe="triton", moe_decode="grouped", cuda_graph_max_bs=0,
                                      piecewise_graphs=False))  # fmt: skip
    ids = _requests(1)[0].input_ids
    for prefix in (ids[:1], ids[:2]):  # one- and two-token batches: decode-sized
        a, b = gemv.score(prefix).float(), grouped.score(prefix).float()
        assert ((a - b).norm() / b.norm()).item() < 2e-2


@pytest.mark.parametrize("mode", ["all"])
def test_one_token_decode_with_the_norms_in_the_gemvs(dummy_dir, mode):
    """decode_norms on a mixture (bf16; the experts' residual add and the next norm inside their
    down GEMV, the route and expert GEMVs launched with PDL): one request's greedy tokens are
    the same in decode graphs with overlap as eager, and with PDL as without; a one-token
    step's logits are those of "off" within bf16's precision. Qwen1.5-MoE's shared expert
    keeps it off."""
    if "qwen1.5" in dummy_dir:
        pytest.skip("a shared expert: decode_norms 'off'")

    def engine(**kernels):
        kernels = dict(moe="triton", moe_decode="gemv", decode_norms=mode, **kernels)
        return _engine(dummy_dir, kernels, overlap=kernels.get("cuda_graph_max_bs", 64) > 0)

    def tokens(**kernels):
        eng = engine(**kernels)
        assert eng.runner.kernels.decode_norms == mode
        out = {r.rid: r.output_ids for r in eng.generate(_requests()[:1])}
        eng.check_integrity()
        return out

    eager = tokens(cuda_graph_max_bs=0, piecewise_graphs=False)
    assert tokens(cuda_graph_max_bs=64) == eager
    assert tokens(cuda_graph_max_bs=64, pdl=False, decode_gemv="triton") == eager
    fused = engine(cuda_graph_max_bs=0, piecewise_graphs=False)
    off = _engine(dummy_dir, dict(moe="triton", decode_norms="off", cuda_graph_max_bs=0,
                                  piecewise_graphs=False))  # fmt: skip
    for token in _requests(1)[0].input_ids[:3]:
        a, b = fused.score([token]).float(), off.score([token]).float()
        assert ((a - b).norm() / b.norm()).item() < 2e-2, token


def test_fused_moe_logits_match_the_torch_loop(dummy_dir):
    fused = _engine(dummy_dir, dict(moe="triton", cuda_graph_max_bs=0, piecewise_graphs=False))
    loop = _engine(dummy_dir, dict(moe="torch", cuda_graph_max_bs=0, piecewise_graphs=False))
    for req in _requests(4):
        a, b = fused.score(req.input_ids).float(), loop.score(req.input_ids).float()
        assert ((a - b).norm() / b.norm()).item() < 2e-2


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="moe_prefill 'grouped_mm': sm_90",
)
def test_grouped_mm_prefill_logits_match_the_triton_gemms_and_the_loop(dummy_dir):
    """A prompt of 1,500 tokens in one prefill step (past 32 routed rows an expert): the default
    on sm_90 in bf16 runs its experts on torch._grouped_mm; its logits are the Triton grouped
    GEMMs' and the torch loop's within bf16's precision."""
    from tiny_models import random_prompts

    def engine(**kernels):
        return _engine(dummy_dir, dict(cuda_graph_max_bs=0, piecewise_graphs=False, **kernels),
                       chunked_prefill_size=2048)  # fmt: skip

    grouped_mm = engine(moe="triton")
    assert grouped_mm.runner.kernels.moe_prefill == "grouped_mm"
    prompt = random_prompts(1, seed=9, min_len=1500, max_len=1500)[0]
    got = grouped_mm.score(prompt).float()
    for other in (engine(moe="triton", moe_prefill="triton"), engine(moe="torch")):
        want = other.score(prompt).float()
        assert ((got - want).norm() / want.norm()).item() < 2e-2


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_tiny_models_equal_transformers_in_fp32_on_the_torch_loop(kind, tmp_path):
    from tiny_models import make_tiny_model, random_prompts

    from batchrun.engine.engine import Engine

    hf = make_tiny_model(kind, tmp_path).cuda()
    kernels = KernelPlan(moe="torch", cuda_graph_max_bs=0, piecewise_graphs=False)
    engine = Engine(EngineConfig(model=str(tmp_path), device="cuda", dtype="float32",
                                 kv_budget=8192), kernels=kernels)  # fmt: skip
    for prompt in random_prompts(3, seed=1, min_len=8, max_len=60):
        ours = engine.score(prompt).float()
        with torch.no_grad():
            ref = hf(torch.tensor([prompt], device="cuda")).logits[0].float()
        assert ((ours - ref).norm() / ref.norm()).item() <= 1e-4
