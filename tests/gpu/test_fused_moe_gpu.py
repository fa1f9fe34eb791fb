"""The fused MoE (kernels/moe_align.py, kernels/fused_moe.py, the decode batches'
kernels/moe_gemv.py and the prefill batches' kernels/moe_grouped_mm.py) on the GPU in bf16, at
the real models' expert widths and 1 to 16,384 tokens, against a per-expert torch loop; no host
sync; the same bits in a CUDA graph as eager.

    pytest tests/gpu/test_fused_moe_gpu.py -q          (a few minutes on an H200)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# (E, k, H, I) of the real models, and the largest's per-rank widths at TP 8
MODELS = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "qwen3-235b-a22b": (128, 8, 4096, 1536),
    "qwen3-235b-a22b-tp8": (128, 8, 4096, 192),
    "qwen1.5-moe-a2.7b": (60, 4, 2048, 1408),
    "qwen1.5-moe-a2.7b-tp8": (60, 4, 2048, 176),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
TOKENS = (1, 2, 7, 16, 64, 255, 1024, 4096, 16384)
# bf16 out against the fp32 loop on the same bf16 operands: the kernel rounds the SwiGLU
# product and each expert's weighted output to bf16 (2^-9 relative each), sums in fp32
BF16_BOUND = 1e-2


def reference_moe(x, w13, w2, topk_weights, topk_ids):
    """The per-expert loop in fp32 on the bf16 operands."""
    inter = w2.shape[2]
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        tokens, slots = torch.where(topk_ids == expert)
        if len(tokens) == 0:
            continue
        h = x[tokens].float() @ w13[expert].float().T
        a = F.silu(h[:, :inter]) * h[:, inter:]
        down = a @ w2[expert].float().T
        y.index_add_(0, tokens, down * topk_weights[tokens, slots, None])
    return y


def make_inputs(num_tokens, num_experts, top_k, hidden, inter, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).to(dtype)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen, dtype=dtype)
    w13 /= hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, device="cuda", generator=gen, dtype=dtype)
    w2 /= inter**0.5
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
    weights, ids = torch.topk(logits.softmax(dim=-1), top_k, dim=-1)
    return x, w13, w2, weights / weights.sum(dim=-1, keepdim=True), ids.int()


def rel_error(got, want) -> float:
    return float((got.float() - want).norm() / want.norm())


@pytest.mark.parametrize("model", list(MODELS))
def test_fused_moe_matches_the_per_expert_loop(model):
    from batchrun.kernels.fused_moe import fused_moe, pick_config, tile_tokens

    num_experts, top_k, hidden, inter = MODELS[model]
    x, w13, w2, weights, ids = make_inputs(16384, num_experts, top_k, hidden, inter)
    for num_tokens in TOKENS:
        args = (x[:num_tokens], w13, w2, weights[:num_tokens], ids[:num_tokens])
        got = fused_moe(*args)
        assert got.dtype == torch.bfloat16 and got.shape == (num_tokens, hidden)
        want = reference_moe(*args)
        rel = rel_error(got, want)
        assert rel < BF16_BOUND, (model, num_tokens, rel)
        assert torch.equal(fused_moe(*args), got), (model, num_tokens)  # deterministic
        if num_tokens >= 255:  # the gathered rows through TMA descriptors (fused_moe_tma.py)
            config = pick_config(tile_tokens(num_tokens), *MODELS[model])._replace(gather=True)
            gathered = fused_moe(*args, config=config)
            assert rel_error(gathered, want) < BF16_BOUND, (model, num_tokens, "gathered")
            assert torch.equal(fused_moe(*args, config=config), gathered)


def test_skewed_routing_fp16_and_int64_ids():
    """Every token on the same two experts (one block row per 128 tokens of one expert), fp16,
    int64 ids."""
    from batchrun.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = make_inputs(4096, 128, 8, 2048, 768, torch.float16)
    ids = torch.tensor([5, 77], device="cuda").repeat(x.shape[0], 1)
    weights = weights[:, :2] / weights[:, :2].sum(dim=-1, keepdim=True)
    got = fused_moe(x, w13, w2, weights, ids)
    assert got.dtype == torch.float16
    assert rel_error(got, reference_moe(x, w13, w2, weights, ids)) < BF16_BOUND


def test_alignment_at_prefill_size():
    from batchrun.kernels.moe_align import align_by_expert

    _, _, _, _, ids = make_inputs(16384, 128, 8, 64, 64)
    sorted_ids, expert_ids, num_padded, _ = align_by_expert(ids, 128, 64)
    counts = torch.bincount(ids.view(-1).long(), minlength=128)
    padded = (counts + 63) // 64 * 64
    assert int(num_padded) == int(padded.sum())
    ends = padded.cumsum(0)
    starts = ends - padded
    for expert in (0, 17, 127):
        group = sorted_ids[int(starts[expert]) : int(ends[expert])]
        rows = torch.nonzero(ids.view(-1) == expert).view(-1).int()
        assert torch.equal(group[: len(rows)], rows)
        assert bool((group[len(rows) :] == ids.numel()).all())
        blocks = expert_ids[int(starts[expert]) // 64 : int(ends[expert]) // 64]
        assert bool((blocks == expert).all())


def test_no_host_sync():
    from batchrun.kernels.fused_moe import fused_moe

    for num_tokens in (1, 300):
        args = make_inputs(num_tokens, 128, 8, 2048, 768)
        fused_moe(*args)  # compile outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fused_moe(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("num_tokens,gather", [(1, False), (8, False), (64, False), (512, False),
                                               (512, True), (4096, True)])  # fmt: skip
def test_cuda_graph_replays_equal_eager(num_tokens, gather):
    """A graph captured on one routing, replayed on others copied into its inputs (gather: the
    TMA descriptors' path, whose descriptors encode the buffers at capture)."""
    from batchrun.kernels.fused_moe import fused_moe, pick_config, tile_tokens

    config = pick_config(tile_tokens(num_tokens), 128, 8, 2048, 768)._replace(gather=gather)
    check_graph_replays(
        lambda x, w13, w2, w, ids: fused_moe(x, w13, w2, w, ids, config), num_tokens
    )


def check_graph_replays(moe, num_tokens: int, seeds=(1, 2, 3)) -> None:
    """moe(x, w13, w2, weights, ids) at Qwen3-30B-A3B's widths captured in a CUDA graph on one
    routing, replayed on others copied into its inputs: the bits of an eager call each time."""
    x, w13, w2, weights, ids = make_inputs(num_tokens, 128, 8, 2048, 768)
    static = [x.clone(), weights.clone(), ids.clone()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe(static[0], w13, w2, static[1], static[2])  # warm-up: compiles
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(static[0], w13, w2, static[1], static[2])
    for seed in seeds:
        nx, _, _, nweights, nids = make_inputs(num_tokens, 128, 8, 2048, 768, seed=seed)
        for buf, new in zip(static, (nx, nweights, nids)):
            buf.copy_(new)
        graph.replay()
        assert torch.equal(out, moe(nx, w13, w2, nweights, nids)), (num_tokens, seed)


needs_grouped_mm = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="torch._grouped_mm's CUTLASS kernels: sm_90",
)


@needs_grouped_mm
@pytest.mark.parametrize("model", list(MODELS))
def test_grouped_mm_moe_matches_the_per_expert_loop(model):
    """kernels/moe_grouped_mm.py at the token counts the rule gives it (past 32 routed rows an
    expert) and below; deterministic; a token's output the same bits with other rows beside it
    in the pass (the buffers sized by tile_tokens)."""
    from batchrun.kernels.moe_grouped_mm import grouped_mm_moe

    num_experts, top_k, hidden, inter = MODELS[model]
    x, w13, w2, weights, ids = make_inputs(16384, num_experts, top_k, hidden, inter)
    for num_tokens in (7, 64, 300, 1024, 4096, 16384):
        args = (x[:num_tokens], w13, w2, weights[:num_tokens], ids[:num_tokens])
        got = grouped_mm_moe(*args)
        assert got.dtype == torch.bfloat16 and got.shape == (num_tokens, hidden)
        rel = rel_error(got, reference_moe(*args))
        assert rel < BF16_BOUND, (model, num_tokens, rel)
        assert torch.equal(grouped_mm_moe(*args), got), (model, num_tokens)
    fewer = grouped_mm_moe(x[:299], w13, w2, weights[:299], ids[:299])
    assert torch.equal(fewer, grouped_mm_moe(x[:300], w13, w2, weights[:300], ids[:300])[:299])


@needs_grouped_mm
def test_grouped_mm_moe_with_gpt_oss_extras_and_no_host_sync():
    """gpt-oss's biases and clamped SwiGLU against layers/moe.py's loop; no host sync."""
    from batchrun.kernels.moe_grouped_mm import grouped_mm_moe

    from batchrun.layers.moe import ExpertExtras, _experts_loop

    x, w13, w2, weights, ids = make_inputs(2048, 32, 4, 2880, 2880)
    gen = torch.Generator(device="cuda").manual_seed(5)
    b13 = torch.randn(32, 2 * 2880, device="cuda", generator=gen).to(torch.bfloat16)
    b2 = torch.randn(32, 2880, device="cuda", generator=gen).to(torch.bfloat16)
    extras = ExpertExtras(b13, b2, alpha=1.702, limit=7.0)
    got = grouped_mm_moe(x, w13, w2, weights, ids, extras=extras)
    want = _experts_loop(x.float(), w13.float(), w2.float(), weights, ids, extras._replace(
        b13=b13.float(), b2=b2.float()))  # fmt: skip
    assert rel_error(got, want) < BF16_BOUND
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_mm_moe(x, w13, w2, weights, ids, extras=extras)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_grouped_mm
@pytest.mark.parametrize("num_tokens", [300, 4096])
def test_grouped_mm_graph_replays_equal_eager(num_tokens):
    """kernels/moe_grouped_mm.py captured on one routing, replayed on others."""
    from batchrun.kernels.moe_grouped_mm import grouped_mm_moe

    check_graph_replays(grouped_mm_moe, num_tokens, seeds=(1, 2))


@pytest.mark.parametrize("model", list(MODELS))
def test_moe_gemv_matches_the_per_expert_loop(model):
    """The decode batches' GEMVs at 1 to 16 tokens (past the rule's MAX_ROWS too), a token's
    row the same whatever rows share its batch's bucket; the split counters left at zero."""
    from batchrun.kernels.fused_moe import tile_tokens
    from batchrun.kernels.gemv import split_counters
    from batchrun.kernels.moe_gemv import moe_gemv

    num_experts, top_k, hidden, inter = MODELS[model]
    x, w13, w2, weights, ids = make_inputs(16, num_experts, top_k, hidden, inter)
    for num_tokens in (1, 2, 3, 4, 7, 16):
        args = (x[:num_tokens], w13, w2, weights[:num_tokens], ids[:num_tokens])
        got = moe_gemv(*args)
        assert got.dtype == torch.bfloat16 and got.shape == (num_tokens, hidden)
        rel = rel_error(got, reference_moe(*args))
        assert rel < BF16_BOUND, (model, num_tokens, rel)
        assert torch.equal(moe_gemv(*args), got), (model, num_tokens)  # deterministic
        if tile_tokens(num_tokens) == tile_tokens(num_tokens + 1):
            more = moe_gemv(x[: num_tokens + 1], w13, w2, weights[: num_tokens + 1],
                            ids[: num_tokens + 1])  # fmt: skip
            assert torch.equal(more[:num_tokens], got), (model, num_tokens)
    torch.cuda.synchronize()
    assert int(split_counters(x.device).abs().sum()) == 0


@pytest.mark.parametrize("num_tokens", [1, 2, 4])
def test_moe_gemv_graph_replays_equal_eager_without_host_sync(num_tokens):
    from batchrun.kernels.moe_gemv import moe_gemv

    x, w13, w2, weights, ids = make_inputs(num_tokens, 128, 8, 2048, 768)
    moe_gemv(x, w13, w2, weights, ids)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_gemv(x, w13, w2, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static = [x.clone(), weights.clone(), ids.clone()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_gemv(static[0], w13, w2, static[1], static[2])
    for seed in (1, 2, 3):
        nx, _, _, nweights, nids = make_inputs(num_tokens, 128, 8, 2048, 768, seed=seed)
        for buf, new in zip(static, (nx, nweights, nids)):
            buf.copy_(new)
        graph.replay()
        assert torch.equal(out, moe_gemv(nx, w13, w2, nweights, nids)), (num_tokens, seed)


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "mixtral-8x7b"])
def test_router_kernel_matches_route_and_ignores_padding(model):
    """kernels/moe_route.py against layers/moe.py's `route` at 1 to 16,384 tokens: the same
    experts (fp32 logits spread like a router's, no near-ties at this scale) and weights within
    fp32 rounding; a token's routing is the same bits with the step padded by other rows."""
    from batchrun.kernels.moe_route import topk_softmax

    from batchrun.layers.moe import route

    experts, top_k = MODELS[model][:2]
    gen = torch.Generator(device="cuda").manual_seed(3)
    for renormalize in (True, False):
        for tokens in TOKENS:
            logits = torch.randn(tokens, experts, device="cuda", generator=gen) * 2
            weights, ids = topk_softmax(logits, top_k, renormalize)
            want_w, want_ids = route(logits, top_k, renormalize)
            assert torch.equal(ids.long(), want_ids), (tokens, renormalize)
            torch.testing.assert_close(weights, want_w, rtol=2e-6, atol=1e-7)
            padded = torch.cat([logits, torch.randn(64, experts, device="cuda", generator=gen)])
            w_pad, ids_pad = topk_softmax(padded, top_k, renormalize)
            assert torch.equal(w_pad[:tokens], weights) and torch.equal(ids_pad[:tokens], ids)


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b"])
def test_route_gemv_matches_the_router_and_route(model):
    """kernels/moe_route.py's route_gemv (the router's fp32 matmul and the routing in one
    kernel) against `route` of F.linear's fp32 logits at 1 to 16 bf16 rows: the same experts,
    weights within fp32 rounding; a token's routing the same bits whatever rows share the batch;
    no host sync; the same bits in a CUDA graph."""
    from batchrun.kernels.moe_route import route_gemv

    from batchrun.layers.moe import route

    experts, top_k, hidden, _ = MODELS[model]
    gen = torch.Generator(device="cuda").manual_seed(4)
    w = torch.randn(experts, hidden, device="cuda", generator=gen) / hidden**0.5 * 4
    x = torch.randn(16, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    for tokens in (1, 2, 5, 16):
        weights, ids = route_gemv(x[:tokens], w, None, top_k, True)
        want_w, want_ids = route(F.linear(x[:tokens].float(), w), top_k, True)
        assert torch.equal(ids.long(), want_ids), (model, tokens)
        torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
        first = route_gemv(x[:1], w, None, top_k, True)
        assert torch.equal(first[0], weights[:1]) and torch.equal(first[1], ids[:1])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        route_gemv(x[:2], w, None, top_k, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static = x[:2].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = route_gemv(static, w, None, top_k, True)
    new = torch.randn(2, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    static.copy_(new)
    graph.replay()
    want = route_gemv(new, w, None, top_k, True)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])


# Gemma 4's experts: (E, k, H, I) of scripts/benchlib.py's gemma-4-moe shape (transformers'
# default Gemma4TextConfig with enable_moe_block), GELU-tanh gate
GEMMA4_MOE = (128, 8, 2304, 704)


def reference_gelu_moe(x, w13, w2, topk_weights, topk_ids):
    """The per-expert loop in fp32 with Gemma 4's gate, gelu_tanh(gate) * up."""
    from batchrun.layers.moe import ExpertExtras, _experts_loop

    extras = ExpertExtras(act="gelu_pytorch_tanh")
    return _experts_loop(x.float(), w13.float(), w2.float(), topk_weights, topk_ids, extras)


@pytest.mark.parametrize("num_tokens", [1, 2, 7, 64, 255, 1024, 4096])
def test_gelu_tanh_experts_at_gemma4_widths(num_tokens):
    """fused_moe (row gather and TMA), moe_gemv (decode batches) and grouped_mm_moe with the
    GELU-tanh epilogue against the loop, bf16; a CUDA graph replays the eager bits (at
    check_graph_replays' widths)."""
    from batchrun.kernels.fused_moe import fused_moe
    from batchrun.kernels.moe_gemv import moe_gemv
    from batchrun.kernels.moe_grouped_mm import grouped_mm_moe

    from batchrun.layers.moe import ExpertExtras

    extras = ExpertExtras(act="gelu_pytorch_tanh")
    args = make_inputs(num_tokens, *GEMMA4_MOE, seed=num_tokens)
    want = reference_gelu_moe(*args)
    runs = [fused_moe] + ([moe_gemv] if num_tokens <= 7 else [])
    if torch.cuda.get_device_capability() == (9, 0):  # torch._grouped_mm's CUTLASS kernels
        runs.append(grouped_mm_moe)
    for run in runs:
        got = run(*args, extras=extras)
        assert rel_error(got, want) < BF16_BOUND, (run.__name__, num_tokens)
        assert rel_error(run(*args), want) > 2 * BF16_BOUND  # the SiLU gate differs
    check_graph_replays(
        lambda x, w13, w2, w, ids: fused_moe(x, w13, w2, w, ids, extras=extras), num_tokens
    )
