"""kernels/int4_matmul.py and kernels/int4_gemv_mma.py on the GPU: int4_matmul's two kernel
shapes against the dequantized torch reference at M from 1 to 8,192 on the llama-8b and llama-1b
projections, bf16; act-order, group sizes, symmetric zero points and a tensor-parallel slice;
the Gluon MMA decode GEMV at M 1 to 16 on the same projections, every scheme it takes, its
SwiGLU epilogue; CUDA graph replay against eager; and the
engine (CUDA graphs on) on a tiny AWQ and a tiny GPTQ act-order checkpoint against the path that
dequantizes at load.

The bound: the kernel multiplies x by the weight dequantized to bf16 ((q - zero) * scale in fp32,
rounded once, as Int4Weight.dequantize(bf16) computes it) with fp32 sums, like the reference
F.linear(x, W_bf16) in fp32: only the order of the sums and y's rounding to bf16 differ, a
relative 2^-8 of an element at most; MAX_REL_ERROR bounds max |y - ref| / max |ref|. The
decode GEMV applies zero and scale after its dot (the weight never rounded to bf16): it differs
from the reference by that rounding too, far inside the bound.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MAX_REL_ERROR = 8e-3
# the SwiGLU epilogue rounds three times (gate, silu, up) as the unfused path does; on fp32 sums
# that differ from the reference's in their last bits each rounding may land one bf16 step
# (<= 2^-7 relative) apart, and the product carries all three
SWIGLU_MAX_REL_ERROR = 3 * 2.0**-7
ROWS = [1, 2, 7, 16, 64, 255, 1024, 8192]
# (N, K) of the projections: llama-8b qkv, o, gate_up, down; llama-1b the same
SHAPES = [
    (6144, 4096),
    (4096, 4096),
    (28672, 4096),
    (4096, 14336),
    (3072, 2048),
    (2048, 2048),
    (16384, 2048),
    (2048, 8192),
]


def random_weight(n: int, k: int, group_size: int, symmetric: bool, act_order: bool, seed: int):
    """An Int4Weight on the GPU: random values and zero points (symmetric: 8), scales near a
    real checkpoint's, and with act-order a g_idx that scatters each group's columns."""
    from batchrun.quant.weights import Int4Weight

    g = torch.Generator(device="cuda").manual_seed(seed)
    group = k if group_size == -1 else group_size
    groups = -(-k // group)
    q = torch.randint(0, 16, (n, k), generator=g, device="cuda", dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=g, device="cuda") * 0.004 + 0.002).half()
    if symmetric:
        zeros = torch.full((n, groups), 8, device="cuda", dtype=torch.uint8)
    else:
        zeros = torch.randint(1, 16, (n, groups), generator=g, device="cuda", dtype=torch.uint8)
    g_idx = None
    if act_order:
        perm = torch.randperm(k, generator=g, device="cuda")
        g_idx = torch.empty(k, dtype=torch.int32, device="cuda")
        g_idx[perm] = (torch.arange(k, device="cuda") // group).int()
    return Int4Weight(q, scales, zeros, group, g_idx)


def check(w, m: int, **kwargs) -> None:
    from batchrun.kernels.int4_matmul import int4_matmul

    from batchrun.quant.int4_layout import pack_int4

    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, w.in_features, generator=g, device="cuda").to(torch.bfloat16)
    y = int4_matmul(x, pack_int4(w), **kwargs)
    ref = F.linear(x.float(), w.dequantize(torch.bfloat16).float())
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    err = float((y.float() - ref).abs().max() / ref.abs().max())
    assert err <= MAX_REL_ERROR, (m, tuple(ref.shape), err)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_awq_shaped_weights_match_the_dequantized_reference(n, k, m):
    """Group size 128 with zero points: AWQ's (and W4A16_ASYM's) scheme."""
    check(random_weight(n, k, 128, symmetric=False, act_order=False, seed=n + k), m)


@pytest.mark.parametrize("m", [1, 16, 255, 1024])
@pytest.mark.parametrize(
    "group_size,symmetric,act_order",
    [
        (128, True, True),
        (32, False, False),
        (64, True, False),
        (-1, False, False),
        (64, False, True),
    ],
)
def test_every_scheme_matches_the_dequantized_reference(m, group_size, symmetric, act_order):
    for n, k in ((4096, 4096), (2048, 8192)):
        w = random_weight(n, k, group_size, symmetric, act_order, seed=m)
        check(w, m)
        if act_order:  # a row-parallel rank's columns: uneven groups, read per column
            check(w.narrow_in(k // 2, k // 2), m)


def test_cuda_graph_replay_equals_eager():
    """Decode (split-K, act-order's x gathered in the kernel) and prefill shapes captured in a
    CUDA graph and replayed on new inputs give the eager results bit for bit."""
    from batchrun.kernels.int4_matmul import int4_matmul, prepare

    from batchrun.quant.int4_layout import pack_int4

    packed = pack_int4(random_weight(4096, 4096, 128, False, True, seed=0))
    prepare(torch.device("cuda"))
    for m in (1, 16, 300):
        x = torch.zeros(m, 4096, device="cuda", dtype=torch.bfloat16)
        int4_matmul(x, packed)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = int4_matmul(x, packed)
        for seed in range(3):
            g = torch.Generator(device="cuda").manual_seed(seed)
            x.copy_(torch.randn(m, 4096, generator=g, device="cuda"))
            graph.replay()
            assert torch.equal(y, int4_matmul(x, packed)), (m, seed)


@pytest.mark.parametrize("group_size,symmetric", [(128, False), (64, True), (-1, False)])
def test_mma_order_gives_the_plain_orders_results(group_size, symmetric):
    """int4_matmul on the weight in mma_pack's order (what an engine layer keeps where
    int4_gemv_mma takes it) gives the plain order's results: the same values reach the same
    tiles, but the compiler may pick another MMA instruction for the other operand layout, so
    sums round apart by an ulp of bf16 at most; decode (split-K) and prefill rows, llama-8b's
    qkv and down_proj, a K of 4,160 (a 128-deep tile's second step past K)."""
    from batchrun.kernels.int4_matmul import int4_matmul, prepare

    from batchrun.quant.int4_layout import mma_pack, pack_int4

    prepare(torch.device("cuda"))
    for n, k in ((6144, 4096), (4096, 14336), (1024, 4160)):
        if group_size > 0 and k % group_size:
            continue
        packed = pack_int4(random_weight(n, k, group_size, symmetric, False, seed=n))
        wm = mma_pack(packed)
        for m in (1, 17, 64, 300, 2048):
            g = torch.Generator(device="cuda").manual_seed(m)
            x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
            ours, plain = int4_matmul(x, wm).float(), int4_matmul(x, packed).float()
            err = float((ours - plain).abs().max() / plain.abs().max())
            assert err <= 2.0**-7, (n, k, m, err)  # an ulp of bf16 at the largest output


@pytest.mark.parametrize(
    "group_size,symmetric,dtype",
    [(128, False, torch.bfloat16), (128, True, torch.float16), (64, False, torch.bfloat16),
     (-1, True, torch.bfloat16)],
)  # fmt: skip
def test_mma_gemv_matches_the_dequantized_reference(group_size, symmetric, dtype):
    """kernels/int4_gemv_mma.py (Gluon, the weight mma_pack-ed) at M 1, 5, 8, 9 and 16 on
    llama-8b's qkv, o_proj and down_proj (split-K by its rule and by hand), llama-1b's qkv, a
    K of 4,160 (one-step chunks, a partial last group), and the fused gate_up of llama-1b and
    llama-8b with the SwiGLU epilogue; CUDA graph replay (a chain of calls launched with PDL,
    each reading the one before) gives the eager results bit for bit."""
    from batchrun.kernels.int4_gemv_mma import int4_gemv_mma

    from batchrun.quant.int4_layout import mma_pack, pack_int4

    def check(w, m, swiglu=False, split_k=None):
        g = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, w.in_features, generator=g, device="cuda").to(dtype)
        wm = mma_pack(pack_int4(w))
        y = int4_gemv_mma(x, wm, swiglu=swiglu, split_k=split_k)
        ref = F.linear(x.float(), w.dequantize(dtype).float())
        if swiglu:
            gate, up = ref.to(dtype).float().chunk(2, dim=-1)
            ref = F.silu(gate).to(dtype).float() * up
        assert y.shape == ref.shape and y.dtype == dtype
        err = float((y.float() - ref).abs().max() / ref.abs().max())
        assert err <= (SWIGLU_MAX_REL_ERROR if swiglu else MAX_REL_ERROR), (m, ref.shape, err)

    # (K 4,160: 64-deep chunks, the last group partial)
    for n, k in ((6144, 4096), (4096, 4096), (4096, 14336), (3072, 2048), (1024, 4160)):
        w = random_weight(n, k, group_size, symmetric, False, seed=n + k)
        for m in (1, 5, 8, 9, 16):
            check(w, m)
        check(w, 1, split_k=1)
        check(w, 3, split_k=3)
    for n, k in ((16384, 2048), (28672, 4096)):
        w = random_weight(n, k, group_size, symmetric, False, seed=n)
        for m in (1, 16):
            check(w, m, swiglu=True)
    packed = mma_pack(pack_int4(random_weight(4096, 4096, group_size, symmetric, False, seed=7)))
    x = torch.zeros(1, 4096, device="cuda", dtype=dtype)

    def chain(x, pdl):  # each call's input the one before's output
        for _ in range(3):
            x = int4_gemv_mma(x, packed, pdl=pdl)
        return x

    chain(x, True)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = chain(x, True)
    for seed in range(3):
        x.copy_(torch.randn(1, 4096, generator=torch.Generator(device="cuda").manual_seed(seed),
                            device="cuda"))  # fmt: skip
        graph.replay()
        assert torch.equal(y, chain(x, False)), seed


@pytest.mark.parametrize("fmt,group_size,act_order", [("awq", 128, False), ("gptq", 64, True)])
def test_engine_with_cuda_graphs_gives_the_dequantized_paths_tokens(fmt, group_size, act_order):
    """A tiny Llama (hidden 128) quantized in the test: the engine on the kernel (decode CUDA
    graphs and piecewise graphs on) picks the greedy tokens of the engine that dequantizes at
    load, teacher-forced, over 64 tokens of each prompt; both are bf16 on the same weights, so
    they part only at near-ties."""
    from quant_checkpoints_int4 import write_int4_checkpoint
    from tiny_models import make_hf_config, random_prompts
    from transformers import AutoModelForCausalLM

    from batchrun.config import EngineConfig, KernelPlan
    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    cfg = make_hf_config("llama")
    cfg.hidden_size, cfg.intermediate_size = 128, 256
    cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(6, seed=2)
    with tempfile.TemporaryDirectory() as tmp:
        write_int4_checkpoint(fmt, hf, Path(tmp), group_size=group_size, act_order=act_order)
        engines = {}
        for path in ("triton", "dequant", "dequant-gemv"):
            kernels = KernelPlan(int4_matmul=path, piecewise_graphs=True)
            config = EngineConfig(model=tmp, device="cuda", dtype="bfloat16", kv_budget=20000)
            engine = Engine(config, kernels)
            assert engine.kernels.cuda_graph_max_bs > 0 and engine.kernels.int4_matmul == path
            if path != "dequant":  # decodes on int4_gemv_mma where it takes the weight
                assert engine.runner.model.layers[0].mlp.down_proj.quant.mma == (not act_order)
            engines[path] = engine
        reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
        theirs = {r.rid: r.output_ids for r in engines["dequant"].generate(reqs)}
        for path in ("triton", "dequant-gemv"):  # scored by prefill: the decode GEMV's test is
            ours = {r.rid: r.output_ids for r in engines[path].generate(reqs)}  # the next one
            forced = 0
            for req in reqs:
                seq = req.input_ids + theirs[req.rid]
                logits = engines[path].score(seq[:-1])  # [T, V]
                picks = logits[len(req.input_ids) - 1 :].argmax(-1).tolist()
                forced += sum(a == b for a, b in zip(picks, theirs[req.rid]))
            free = sum(
                a == b for r in reqs for a, b in zip(ours[r.rid], theirs[r.rid])
            )  # fmt: skip
            total = 64 * len(reqs)
            print(f"{fmt} {path}: identical greedy tokens {forced / total:.3f} teacher-forced, "
                  f"{free / total:.3f} free")  # fmt: skip
            assert forced / total >= 0.95, (path, forced / total, free / total)
        del engines


@pytest.mark.parametrize("kernel", ["int4", "int4_dense"])
def test_decode_batches_of_an_int4_layer_run_on_the_tensor_core_gemv(kernel):
    """QuantMatmul with kernel "int4" (int4_matmul "triton") and "int4_dense" ("dequant-gemv"):
    the AWQ-shaped weight of llama-8b's gate_up kept in int4_gemv_mma's order; batches of 1 to
    16 rows run on it (the SwiGLU gate too), within the bound of the dequantized reference;
    int4_dense's larger batches are F.linear on its bf16 weight, bit for bit."""
    from unittest import mock

    from batchrun.kernels import int4_gemv_mma

    from batchrun.quant.linear import QuantMatmul, QuantSpec

    n, k = 28672, 4096
    w = random_weight(n, k, 128, symmetric=False, act_order=False, seed=5)
    spec = QuantSpec("int4", "none", None, kernel, "test")
    layer = QuantMatmul(n, k, spec, torch.bfloat16, "cuda")
    layer.load(w, "test")
    assert layer.mma and layer.qweight.dim() == 4
    dense = w.dequantize(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    for m in (1, 7, 16):
        x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
        assert layer.takes_gemv(x)
        spy = mock.patch.object(int4_gemv_mma, "int4_gemv_mma", wraps=int4_gemv_mma.int4_gemv_mma)
        with spy as calls:
            y, a = layer(x), layer.gemv(x, swiglu=True)
        assert calls.call_count == 2, m
        ref = F.linear(x.float(), dense.float())
        err = float((y.float() - ref).abs().max() / ref.abs().max())
        assert err <= MAX_REL_ERROR, (m, err)
        gate, up = ref.bfloat16().float().chunk(2, dim=-1)
        ref_a = F.silu(gate).bfloat16().float() * up
        err = float((a.float() - ref_a).abs().max() / ref_a.abs().max())
        assert err <= SWIGLU_MAX_REL_ERROR, (m, err)
    if kernel == "int4_dense":
        x = torch.randn(300, k, generator=g, device="cuda").to(torch.bfloat16)
        assert torch.equal(layer(x), F.linear(x, dense))
