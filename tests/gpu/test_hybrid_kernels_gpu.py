"""The hybrid models' GPU path (KernelPlan.linear_attention "fla") against the plain-torch
reference (models/blocks/delta_rule.py):

- fla-core's chunked delta rule over packed batches of requests of 1 to 32k tokens (chunk
  boundaries 63, 64, 65, 127, 128, 129), each from a random initial state in a StatePool slot out
  of order, outputs and final states; the recurrent kernel's decode batches; fp32 and bf16 pools;
- kernels/causal_conv1d.py against F.conv1d (delta_rule.causal_conv) request by request, the
  conv states in place;
- no host sync in the layer's kernels (torch.cuda.set_sync_debug_mode "error");
- a tiny Qwen3.5 engine's greedy tokens in fp32: the fla path, eager and with decode CUDA graphs
  (the states in the graphs' inputs), overlap on and off, equal the reference plan's (the CPU's
  path, KernelPlan.reference(), run on this GPU).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchrun.attention.base import AttentionInputs
from batchrun.config import EngineConfig, KernelPlan
from batchrun.engine.state_pool import StatePool
from batchrun.models.hybrid_config import LinearAttentionConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# NOTE: Triton runs fp32 dots in TF32 unless told otherwise; the fp32 engines here are compared
# token for token with the torch reference, so fla's fp32 dots run in full fp32 (set before any
# kernel of this process compiles: collection imports every module first)
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

# Qwen3.5's head shape (Dk = Dv = 128), fewer heads
LIN = LinearAttentionConfig(layers=(0,), num_k_heads=2, num_v_heads=4, head_k_dim=128,
                            head_v_dim=128, conv_kernel=4, fused_projections=False)  # fmt: skip
PACKED = (
    (1, 63, 64, 65, 127, 128, 129, 2),  # chunk boundaries, decode rows among prefill rows
    (1000, 1, 77),
    (4096,),
    (32768,),
)


def _pool(lengths, dtype: str = "float32", seed: int = 0) -> StatePool:
    """A pool of random states whose step is `lengths` (every request continues: none starts
    at position 0), its rows out of order."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_rows = 2 * len(lengths) + 1
    pool = StatePool(LIN)
    pool.allocate(num_rows, "cuda", dtype)
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=gen, device="cuda"))
    pool.ssm.copy_(torch.randn(pool.ssm.shape, generator=gen, device="cuda") * 0.1)
    rows = [num_rows - 2 - 2 * b for b in range(len(lengths))]
    t = lambda xs: torch.tensor(xs, device="cuda")  # noqa: E731
    seq = [n + 5 for n in lengths]
    pool.prepare(
        AttentionInputs(t(rows), t(seq), t(list(lengths)), t([0] * sum(lengths)), tuple(seq),
                        tuple(lengths))
    )  # fmt: skip
    return pool


def _inputs(num_tokens: int, seed: int = 1):
    """q, k [T, Hk, Dk], v [T, Hv, Dv] bf16; g (log decay) and beta [T, Hv] as the layer makes
    them."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q = rand(num_tokens, LIN.num_k_heads, LIN.head_k_dim).bfloat16()
    k = rand(num_tokens, LIN.num_k_heads, LIN.head_k_dim).bfloat16()
    v = rand(num_tokens, LIN.num_v_heads, LIN.head_v_dim).bfloat16()
    g = -F.softplus(rand(num_tokens, LIN.num_v_heads) - 2.0)  # fp32, < 0
    beta = rand(num_tokens, LIN.num_v_heads).sigmoid().bfloat16()
    return q, k, v, g, beta


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lengths", PACKED, ids=lambda ls: "-".join(map(str, ls)))
def test_fla_delta_rule_matches_torch(lengths, state_dtype):
    from batchrun.models.blocks import delta_rule, delta_rule_fla

    pool = _pool(lengths, state_dtype)
    ssm = pool.ssm[0]
    before = ssm.clone()
    q, k, v, g, beta = _inputs(sum(lengths))
    got = delta_rule_fla.delta_rule(q, k, v, g, beta, ssm, pool)
    start = 0
    for b, n in enumerate(lengths):
        row = int(pool.rows[b])
        seg = slice(start, start + n)
        rule = delta_rule.recurrent if n == 1 else delta_rule.chunked
        want, state = rule(q[None, seg], k[None, seg], v[None, seg], g[None, seg],
                           beta[None, seg], before[row : row + 1].float())  # fmt: skip
        assert _rel(got[seg], want[0]) < 2e-2, (n, _rel(got[seg], want[0]))
        assert _rel(ssm[row], state[0]) < 2e-2, (n, _rel(ssm[row], state[0]))
        start += n
    untouched = [r for r in range(ssm.shape[0]) if r not in pool.rows.tolist()]
    assert torch.equal(ssm[untouched], before[untouched])


@pytest.mark.parametrize("batch", [1, 5, 64])
def test_fla_decode_matches_torch(batch):
    from batchrun.models.blocks import delta_rule, delta_rule_fla

    pool = _pool((1,) * batch)
    ssm = pool.ssm[0]
    before = ssm.clone()
    q, k, v, g, beta = _inputs(batch, seed=batch)
    got = delta_rule_fla.delta_rule(q, k, v, g, beta, ssm, pool)
    rows = pool.rows
    want, state = delta_rule.recurrent(q[:, None], k[:, None], v[:, None], g[:, None],
                                       beta[:, None], before[rows].float())  # fmt: skip
    assert _rel(got, want[:, 0]) < 1e-2 and _rel(ssm[rows], state) < 1e-2


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lengths", [(1, 2, 3, 4, 5, 100), (1,) * 7, (4097, 1)], ids=str)
def test_causal_conv1d_matches_f_conv1d(lengths, state_dtype):
    from batchrun.models.blocks import delta_rule
    from batchrun.models.blocks.delta_rule_fla import conv

    pool = _pool(lengths, state_dtype)
    states = pool.conv[0]
    before = states.clone()
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(sum(lengths), LIN.conv_dim, generator=gen, device="cuda").bfloat16()
    weight = torch.randn(LIN.conv_dim, 1, LIN.conv_kernel, generator=gen, device="cuda")
    weight = weight.bfloat16()
    got = conv(x, weight, states, pool)
    start = 0
    for b, n in enumerate(lengths):
        row = int(pool.rows[b])
        seg = x[start : start + n].float()
        want, state = delta_rule.causal_conv(seg, weight.float(), before[row].float())
        torch.testing.assert_close(got[start : start + n].float(), want, rtol=2e-2, atol=2e-2)
        assert torch.equal(states[row], state.to(states.dtype)), (n, row)
        start += n


def test_the_layer_kernels_make_no_host_sync():
    from batchrun.models.blocks.delta_rule_fla import conv, delta_rule

    for lengths in [(300, 1, 65), (1, 1, 1)]:  # a packed prefill step, then a decode step
        pool = _pool(lengths)
        q, k, v, g, beta = _inputs(sum(lengths))
        x = torch.randn(sum(lengths), LIN.conv_dim, device="cuda").bfloat16()
        weight = torch.randn(LIN.conv_dim, 1, LIN.conv_kernel, device="cuda").bfloat16()
        for check in (False, True):  # a warm-up (Triton compiles, fla autotunes), then checked
            pool.step_cache = {}
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if check else "default")
            try:
                conv(x, weight, pool.conv[0], pool)
                delta_rule(q, k, v, g, beta, pool.ssm[0], pool)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


# -- the engine ---------------------------------------------------------------------------------

NEW = 32
LENGTHS = (1, 2, 3, 9, 64, 65, 127, 128, 300)


@pytest.fixture(scope="module")
def tiny_qwen35(tmp_path_factory):
    from hybrid_models import make_hybrid_model

    path = tmp_path_factory.mktemp("qwen3_5_text")
    make_hybrid_model("qwen3_5_text", path)
    return str(path)


def _greedy(model_dir: str, kernels: KernelPlan, **changes):
    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    fields = dict(model=model_dir, device="cuda", dtype="float32", kv_budget=8192,
                  chunked_prefill_size=100, **changes)  # fmt: skip
    engine = Engine(EngineConfig(**fields), kernels=kernels)
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    reqs = [
        GenerateRequest(str(i), torch.randint(3, 256, (n,), generator=gen).tolist(), params)
        for i, n in enumerate(LENGTHS)
    ]
    out = {r.rid: r.output_ids for r in engine.generate(reqs)}
    engine.check_integrity()
    return engine, out


@pytest.fixture(scope="module")
def reference(tiny_qwen35):
    return _greedy(tiny_qwen35, KernelPlan.reference(), overlap=False)[1]


@pytest.mark.parametrize(
    "plan,changes",
    [
        (KernelPlan(linear_attention="fla", cuda_graph_max_bs=0), dict(overlap=False)),
        (KernelPlan(linear_attention="fla", cuda_graph_max_bs=16), dict(overlap=False)),
        (KernelPlan(linear_attention="fla", cuda_graph_max_bs=16), dict(overlap=True)),
        (KernelPlan(linear_attention="fla", cuda_graph_max_bs=16),
         dict(overlap=True, max_running=6)),  # decode batches padded, 1-token prompts later
        (KernelPlan(linear_attention="torch", cuda_graph_max_bs=16), dict(overlap=True)),
    ],
    ids=["fla-eager", "fla-graph", "fla-graph-overlap", "fla-graph-padded", "torch-graph"],
)  # fmt: skip
def test_engine_greedy_tokens_equal_the_reference(tiny_qwen35, reference, plan, changes):
    engine, got = _greedy(tiny_qwen35, plan, **changes)
    assert engine.kernels.linear_attention == plan.linear_attention
    assert (engine.runner.graphs is not None) == (plan.cuda_graph_max_bs > 0)
    assert got == reference


def test_engine_runs_bf16_states_with_graphs(tiny_qwen35):
    engine, got = _greedy(tiny_qwen35, KernelPlan(), dtype="bfloat16",
                          linear_state_dtype="bfloat16")  # fmt: skip
    assert engine.kernels.linear_attention == "fla" and engine.runner.graphs is not None
    assert engine.runner.states.ssm.dtype == torch.bfloat16
    assert all(len(ids) == NEW for ids in got.values())
