"""The fused MoE (kernels/moe_route.py, kernels/moe_align.py, kernels/fused_moe.py, the decode
batches' kernels/moe_gemv.py, the prefill batches' kernels/moe_grouped_mm.py on torch's CPU
grouped matmul) under Triton's CPU interpreter: the router against layers/moe.py's
`route`, the alignment against its definition, the experts against a per-expert torch loop
written here.

Widths are scaled down for the interpreter; the expert counts (8, 60, 128) and top-k (1, 2, 4, 8)
are the real models'. fp32 and fp16 only: the interpreter's tl.dot is wrong for bf16
(tests/gpu/test_fused_moe_gpu.py runs bf16 at the real widths). Skipped where triton is not
installed; the checks run in a subprocess (TRITON_INTERPRET must be set before triton is first
imported).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.slow  # CI's slow tier (BATCHRUN_SLOW_TESTS=1)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_fused_moe_under_interpreter():
    from triton_interpreter import run_under_interpreter

    run_under_interpreter(__file__)


def reference_moe(x, w13, w2, topk_weights, topk_ids):
    """The per-expert loop in fp32: each expert's rows gathered, its MLP, the weighted sum."""
    inter = w2.shape[2]
    y = torch.zeros(x.shape, dtype=torch.float32)
    for expert in range(w13.shape[0]):
        tokens, slots = torch.where(topk_ids == expert)
        if len(tokens) == 0:
            continue
        h = x[tokens].float() @ w13[expert].float().T
        a = F.silu(h[:, :inter]) * h[:, inter:]
        down = a @ w2[expert].float().T
        y.index_add_(0, tokens, down * topk_weights[tokens, slots, None])
    return y


def make_routing(num_tokens, num_experts, top_k, gen, experts=None):
    """Distinct experts per token (as top-k gives), drawn from `experts` (default all), and
    renormalized weights."""
    pool = torch.arange(num_experts) if experts is None else torch.tensor(experts)
    picks = torch.rand(num_tokens, len(pool), generator=gen).argsort(dim=1)[:, :top_k]
    ids = pool[picks]
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    return weights / weights.sum(dim=1, keepdim=True), ids


def _check_alignment():
    from batchrun.kernels.moe_align import align_by_expert, max_blocks

    gen = torch.Generator().manual_seed(0)
    cases = [(1, 8, 2, 16), (7, 8, 1, 16), (300, 60, 4, 32), (33, 128, 8, 16), (300, 8, 8, 128)]
    cases.append((1500, 8, 2, 64))  # 3000 rows: several steps of 1024
    cases.append((5000, 8, 2, 16))  # past LONG_ROWS: steps of 2048
    for num_tokens, num_experts, top_k, block_m in cases:
        for dtype in (torch.int32, torch.int64):
            _, ids = make_routing(num_tokens, num_experts, top_k, gen)
            ids = ids.to(dtype)
            sorted_ids, expert_ids, num_padded, ends = align_by_expert(
                ids, num_experts, block_m, ends=True
            )
            num_rows = ids.numel()
            blocks = max_blocks(num_rows, num_experts, block_m)
            assert sorted_ids.shape == (blocks * block_m,) and expert_ids.shape == (blocks,)
            flat = ids.view(-1)
            counts = torch.bincount(flat, minlength=num_experts)
            padded = (counts + block_m - 1) // block_m * block_m
            assert int(num_padded) == int(padded.sum()) <= blocks * block_m
            assert ends.dtype == torch.int32 and torch.equal(ends.long(), padded.cumsum(0))
            start = 0
            for expert in range(num_experts):
                group = sorted_ids[start : start + int(padded[expert])]
                rows = torch.nonzero(flat == expert).view(-1).int()
                assert torch.equal(group[: len(rows)], rows), (expert, block_m)
                assert bool((group[len(rows) :] == num_rows).all())
                first, last = start // block_m, (start + int(padded[expert])) // block_m
                assert bool((expert_ids[first:last] == expert).all())
                start += int(padded[expert])
    # the bound is reached: every expert gets one row more than a whole number of blocks
    ids = torch.arange(4).repeat_interleave(17).view(-1, 1)
    sorted_ids, _, num_padded, _ = align_by_expert(ids, 4, 16)
    assert int(num_padded) == sorted_ids.numel() == max_blocks(68, 4, 16) * 16 == 128


def _check_experts(dtype, rel_bound, every=1):
    from batchrun.kernels.fused_moe import fused_moe

    gen = torch.Generator().manual_seed(1)
    # (T, E, k, H, I): decode and prefill buckets of the rule, H and I off the tile sizes,
    # experts with no rows (E = 128, T = 1), every expert in the 128-row bucket (T * k / E > 256)
    cases = [
        (1, 8, 2, 64, 32),
        (5, 8, 1, 96, 48),
        (300, 8, 2, 128, 64),
        (300, 8, 8, 64, 32),
        (1, 60, 4, 64, 96),
        (64, 60, 4, 80, 40),
        (200, 60, 4, 64, 32),
        (1, 128, 8, 64, 32),
        (33, 128, 8, 48, 64),
        (300, 128, 8, 64, 32),
    ]
    for case in cases[::every]:
        check_against_loop(fused_moe, case, dtype, rel_bound, gen)


def check_against_loop(moe, case, dtype, rel_bound, gen):
    """moe(x, w13, w2, weights, ids) on a random case (T, E, k, H, I) in dtype against the loop;
    returns (got, x, w13, w2, weights, ids)."""
    num_tokens, num_experts, top_k, hidden, inter = case
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    weights, ids = make_routing(num_tokens, num_experts, top_k, gen)
    want = reference_moe(x, w13, w2, weights, ids)
    got = moe(x, w13, w2, weights, ids.int())
    assert got.dtype == dtype and got.shape == x.shape
    rel = float((got.float() - want).norm() / want.norm())
    assert rel < rel_bound, (*case, dtype, rel)
    return got, x, w13, w2, weights, ids


def _check_configs_and_edges():
    """Every bucket's tiles on one shape, a few experts only, T = 0, chunked passes, int64 ids,
    strided x."""
    from batchrun.kernels import fused_moe as module
    from batchrun.kernels.fused_moe import fused_moe, pick_config

    gen = torch.Generator().manual_seed(2)
    num_tokens, num_experts, top_k, hidden, inter = 70, 16, 4, 96, 80
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    weights, ids = make_routing(num_tokens, num_experts, top_k, gen, experts=[0, 3, 9, 14, 15])
    want = reference_moe(x, w13, w2, weights, ids)
    for tokens in (1, 100, 1000, 100000):  # T * k / E in each bucket
        config = pick_config(tokens, num_experts, top_k, hidden, inter)
        for gather in (False, True):  # True: kernels/fused_moe_tma.py's descriptors
            config = config._replace(gather=gather)
            got = module.fused_moe(x, w13, w2, weights, ids, config=config)
            assert float((got - want).norm() / want.norm()) < 1e-5, config
    # the gathered rows past 32 rows an expert (the 64- and 128-row blocks)
    assert not any(pick_config(t, 128, 8, 2048, 768).gather for t in (1, 64, 512))
    assert all(pick_config(t, 128, 8, 2048, 768).gather for t in (513, 1024, 16384))

    # decode: 32-column tiles where 64 would leave the SMs idle
    assert pick_config(1, 128, 8, 2048, 768).gate_up.block_n == 32
    assert pick_config(64, 128, 8, 2048, 768).gate_up.block_n == 64
    assert pick_config(16384, 128, 8, 2048, 768).block_m == 128

    empty = fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, hidden)

    saved = module.MAX_CHUNK_ROWS
    module.MAX_CHUNK_ROWS = 36  # 9 tokens a pass: 8 passes, the last one short
    try:
        got = fused_moe(x, w13, w2, weights, ids)
    finally:
        module.MAX_CHUNK_ROWS = saved
    assert float((got - want).norm() / want.norm()) < 1e-5

    wide = torch.randn(num_tokens, 2 * hidden, generator=gen)
    wide[:, :hidden] = x  # x with a row stride of 2H
    for gather in (False, True):
        config = pick_config(1000, num_experts, top_k, hidden, inter)._replace(gather=gather)
        got = fused_moe(wide[:, :hidden], w13, w2, weights, ids, config=config)
        assert float((got - want).norm() / want.norm()) < 1e-5

    # the descriptors' rule: rows of whole 16-byte units, contiguous weights
    from batchrun.kernels.fused_moe import takes_descriptors

    assert takes_descriptors(x, w13, w2)  # 96 and 80 fp32 elements
    assert not takes_descriptors(x[:, :90], w13[:, :, :90], w2[:, :90])
    assert not takes_descriptors(x.half()[:, :36], w13.half()[:, :, :36], w2.half()[:, :36])


def _check_grouped_mm(dtype, rel_bound):
    """kernels/moe_grouped_mm.py against the loop: the real models' expert counts and top-k, H and
    I off the tiles, gpt-oss's biases and clamped SwiGLU (layers/moe.py's loop), several passes,
    strided x, no tokens; a token's output the same bits whatever rows share its pass."""
    from batchrun.kernels import moe_grouped_mm as module
    from batchrun.kernels.moe_grouped_mm import grouped_mm_moe, takes_grouped_mm

    from batchrun.layers.moe import ExpertExtras, _experts_loop

    gen = torch.Generator().manual_seed(4)
    cases = [(300, 8, 2, 128, 64), (300, 128, 8, 64, 32), (70, 60, 4, 80, 40), (5, 8, 1, 96, 48)]
    for case in cases:
        got, x, w13, w2, weights, ids = check_against_loop(grouped_mm_moe, case, dtype,
                                                           rel_bound, gen)  # fmt: skip
        fewer = grouped_mm_moe(x[:-1], w13, w2, weights[:-1], ids[:-1])
        assert torch.equal(fewer, got[:-1]), case

    num_tokens, num_experts, top_k, hidden, inter = 70, 16, 4, 96, 80
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    weights, ids = make_routing(num_tokens, num_experts, top_k, gen, experts=[0, 3, 9, 14, 15])
    extras = ExpertExtras(
        torch.randn(num_experts, 2 * inter, generator=gen), torch.randn(num_experts, hidden,
        generator=gen), alpha=1.702, limit=7.0,
    )  # fmt: skip
    for e in (None, extras, extras._replace(limit=0.0, b2=None)):
        want = _experts_loop(x, w13, w2, weights, ids, e or ExpertExtras())
        got = grouped_mm_moe(x, w13, w2, weights, ids, extras=e)
        assert float((got - want).norm() / want.norm()) < 1e-5, e
    want = reference_moe(x, w13, w2, weights, ids)
    saved = module.MAX_H_ELEMENTS
    module.MAX_H_ELEMENTS = 0  # passes of TILE_STEP (256) tokens: 350 tokens in two
    try:
        assert module.tokens_per_pass(top_k, inter) == 256  # fused_moe's TILE_STEP
        got = grouped_mm_moe(x.repeat(5, 1), w13, w2, weights.repeat(5, 1), ids.repeat(5, 1))
    finally:
        module.MAX_H_ELEMENTS = saved
    assert float((got - want.repeat(5, 1)).norm() / want.repeat(5, 1).norm()) < 1e-5
    wide = torch.randn(num_tokens, 2 * hidden, generator=gen)
    wide[:, :hidden] = x  # x with a row stride of 2H
    got = grouped_mm_moe(wide[:, :hidden], w13, w2, weights, ids)
    assert float((got - want).norm() / want.norm()) < 1e-5
    assert grouped_mm_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, hidden)

    # past 32 routed rows an expert, counted at tile_tokens(T); passes no shorter than
    # fused_moe's (Mixtral's 1,024 tokens against 16,384); operands of whole 16-byte rows
    assert not takes_grouped_mm(512, 128, 8, 2048, 768)  # 32 an expert
    assert takes_grouped_mm(513, 128, 8, 2048, 768) and takes_grouped_mm(16384, 128, 8, 2048, 768)
    assert takes_grouped_mm(300, 8, 2, 4096, 14336) and takes_grouped_mm(1024, 8, 2, 4096, 14336)
    assert not takes_grouped_mm(1025, 8, 2, 4096, 14336)
    assert not takes_grouped_mm(4096, 128, 8, 2048, 100)
    assert module.tokens_per_pass(8, 768) == 4096 and module.tokens_per_pass(2, 14336) == 1024


def _check_gelu_tanh(dtype, rel_bound):
    """Gemma 4's experts (ExpertExtras act "gelu_pytorch_tanh") on the fused experts (the row
    gather and the TMA path), the decode GEMVs and the grouped matmuls, against layers/moe.py's
    loop with the same gate (F.gelu tanh)."""
    from batchrun.kernels.fused_moe import fused_moe
    from batchrun.kernels.moe_gemv import moe_gemv
    from batchrun.kernels.moe_grouped_mm import grouped_mm_moe

    from batchrun.layers.moe import ExpertExtras, _experts_loop

    gen = torch.Generator().manual_seed(7)
    extras = ExpertExtras(act="gelu_pytorch_tanh")
    # (T, E, k, H, I): decode, the 32-row blocks, the gathered 64-row blocks; Gemma 4's top 8
    cases = [(1, 8, 2, 64, 32), (5, 16, 8, 96, 48), (40, 8, 2, 128, 64), (300, 8, 2, 64, 32)]
    for num_tokens, num_experts, top_k, hidden, inter in cases:
        x = (torch.randn(num_tokens, hidden, generator=gen) * 2).to(dtype)
        w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
        w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
        weights, ids = make_routing(num_tokens, num_experts, top_k, gen)
        want = _experts_loop(x.float(), w13.float(), w2.float(), weights, ids, extras)
        silu = _experts_loop(x.float(), w13.float(), w2.float(), weights, ids, ExpertExtras())
        runs = [fused_moe, grouped_mm_moe] + ([moe_gemv] if num_tokens <= 5 else [])
        for run in runs:
            got = run(x, w13, w2, weights, ids, extras=extras).float()
            err = float((got - want).norm() / want.norm())
            assert err < rel_bound, (run.__name__, num_tokens, err)
            assert float((got - silu).norm() / silu.norm()) > 10 * rel_bound  # not SiLU
    with pytest.raises(ValueError, match="gate activations"):
        fused_moe(x, w13, w2, weights, ids, extras=ExpertExtras(act="relu"))


def _check_gemv(dtype, rel_bound):
    """kernels/moe_gemv.py: the decode batches' experts against the loop (top-k 1 to 8, H and I
    off the tile sizes, T past the rule's MAX_ROWS too), bit-identical on a second call (the
    split counters left at zero) and for a token whatever rows pad the batch."""
    from batchrun.kernels.fused_moe import tile_tokens
    from batchrun.kernels.gemv import split_counters
    from batchrun.kernels.moe_gemv import moe_gemv, pick_config, takes_gemv

    gen = torch.Generator().manual_seed(3)
    cases = [
        (1, 8, 2, 64, 32),
        (3, 8, 2, 96, 48),
        (5, 8, 1, 96, 48),
        (1, 60, 4, 64, 96),
        (2, 60, 4, 80, 40),
        (1, 128, 8, 64, 32),
        (2, 128, 8, 48, 64),
        (2, 8, 8, 64, 32),
        (9, 8, 2, 64, 32),
    ]
    for num_tokens, num_experts, top_k, hidden, inter in cases:
        x = torch.randn(num_tokens + 1, hidden, generator=gen).to(dtype)
        w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
        w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
        weights, ids = make_routing(num_tokens + 1, num_experts, top_k, gen)
        x, padded = x[:num_tokens], (x, weights, ids.int())
        weights, ids = weights[:num_tokens], ids[:num_tokens]
        want = reference_moe(x, w13, w2, weights, ids)
        got = moe_gemv(x, w13, w2, weights, ids.int())
        assert got.dtype == dtype and got.shape == x.shape
        rel = float((got.float() - want).norm() / want.norm())
        assert rel < rel_bound, (num_tokens, num_experts, top_k, hidden, inter, dtype, rel)
        assert torch.equal(moe_gemv(x, w13, w2, weights, ids), got)
        assert int(split_counters(x.device).abs().sum()) == 0
        if tile_tokens(num_tokens) == tile_tokens(num_tokens + 1):  # one bucket, one config
            with_pad = moe_gemv(padded[0], w13, w2, padded[1], padded[2])
            assert torch.equal(with_pad[:num_tokens], got), (num_tokens, num_experts, top_k)
    assert takes_gemv(1, 8, 128) and takes_gemv(2, 8, 128) and not takes_gemv(3, 8, 128)
    assert takes_gemv(4, 2, 8) and not takes_gemv(5, 2, 8) and not takes_gemv(0, 2, 8)
    assert takes_gemv(8, 2, 16) and not takes_gemv(9, 2, 16)
    # Qwen3-30B-A3B at one token: 16 gate columns (384 programs), 64 down columns (256)
    assert pick_config(8, 2048, 768, 2)[:2] == (16, 64)
    assert pick_config(2, 4096, 14336, 2)[:2] == (32, 32)  # Mixtral
    assert pick_config(8, 2048, 768, 4).block_k == 128


def _check_gemv_residual():
    """kernels/moe_gemv.py's moe_gemv_residual: h = moe_gemv(...) + residual bit for bit (top-k
    1, 2 and 8; 1 to 3 tokens), and for one token the next norm computed by the down kernel's
    last column tile within an ulp of kernels/fused_norm.py's rms_norm of h; the counters left
    at zero."""
    from batchrun.kernels.fused_norm import rms_norm
    from batchrun.kernels.gemv import split_counters
    from batchrun.kernels.moe_gemv import moe_gemv, moe_gemv_residual
    from test_fused_kernels_interpreter import max_ulps

    gen = torch.Generator().manual_seed(4)
    dtype = torch.float16
    for num_tokens, num_experts, top_k, hidden, inter in (
        (1, 8, 2, 96, 48), (1, 128, 8, 64, 32), (1, 8, 1, 80, 40), (3, 60, 4, 64, 96),
    ):  # fmt: skip
        x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
        w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
        w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
        weights, ids = make_routing(num_tokens, num_experts, top_k, gen)
        ids = ids.int()
        residual = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
        norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
        want_h = (moe_gemv(x, w13, w2, weights, ids).float() + residual.float()).to(dtype)
        h, normed = moe_gemv_residual(x, w13, w2, weights, ids, residual)
        assert torch.equal(h, want_h) and normed is None, (num_tokens, num_experts, top_k)
        if num_tokens == 1:
            h, normed = moe_gemv_residual(x, w13, w2, weights, ids, residual, (norm_w, 1e-5))
            assert torch.equal(h, want_h)
            assert max_ulps(normed, rms_norm(want_h, norm_w, 1e-5)) <= 1, (num_experts, top_k)
        assert int(split_counters(x.device).abs().sum()) == 0


def _check_route():
    """kernels/moe_route.py against layers/moe.py's `route` (softmax, topk, renormalize) on random
    logits, and on tied logits against a stable sort: of equal probabilities the lower id first."""
    from batchrun.kernels.moe_route import topk_softmax

    from batchrun.layers.moe import route

    gen = torch.Generator().manual_seed(7)
    for experts, top_k in ((8, 1), (8, 2), (60, 4), (128, 8), (32, 4)):
        for renormalize in (True, False):
            logits = torch.randn(37, experts, generator=gen) * 3
            weights, ids = topk_softmax(logits, top_k, renormalize)
            want_w, want_ids = route(logits, top_k, renormalize)
            assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids)
            torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)
    tied = torch.randint(0, 3, (64, 60), generator=gen).float()  # three values, many ties
    weights, ids = topk_softmax(tied, 4, True)
    probs = torch.softmax(tied, dim=-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :4]
    assert torch.equal(ids.long(), order)
    top = probs.gather(1, order)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)
    assert topk_softmax(torch.empty(0, 8), 2, True)[1].shape == (0, 2)


def _check_route_gemv():
    """kernels/moe_route.py's route_gemv (the router's matmul and routing in one kernel) against
    `route` of the fp32 logits: the real models' expert counts and top-k, H off the tiles, 1 to
    16 tokens of bf16 / fp32, with gpt-oss's bias; a token's routing the same whatever rows
    share the batch; the counter left at zero."""
    from batchrun.kernels.gemv import split_counters
    from batchrun.kernels.moe_route import route_gemv

    from batchrun.layers.moe import route

    gen = torch.Generator().manual_seed(8)
    for experts, top_k, hidden, bias, renormalize in (
        (128, 8, 2048, False, True), (60, 4, 200, False, False), (8, 2, 300, False, True),
        (32, 4, 96, True, True),
    ):  # fmt: skip
        w = torch.randn(experts, hidden, generator=gen) / hidden**0.5
        b = torch.randn(experts, generator=gen) if bias else None
        for num_tokens, dtype in ((1, torch.float32), (3, torch.float16), (16, torch.float32)):
            x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
            logits = torch.nn.functional.linear(x.float(), w, b)
            weights, ids = route_gemv(x, w, b, top_k, renormalize)
            want_w, want_ids = route(logits, top_k, renormalize)
            assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids)
            torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
            one_w, one_ids = route_gemv(x[:1], w, b, top_k, renormalize)
            assert torch.equal(one_ids, ids[:1]) and torch.equal(one_w, weights[:1])
            assert int(split_counters(x.device).abs().sum()) == 0


def _run_checks():
    _check_route()
    _check_route_gemv()
    _check_alignment()
    _check_experts(torch.float32, 1e-5)
    _check_experts(torch.float16, 2e-3, every=2)
    _check_gemv(torch.float32, 1e-5)
    _check_gemv(torch.float16, 2e-3)
    _check_gemv_residual()
    _check_grouped_mm(torch.float32, 1e-5)
    _check_grouped_mm(torch.float16, 2e-3)
    _check_gelu_tanh(torch.float32, 1e-5)
    _check_gelu_tanh(torch.float16, 2e-3)
    _check_configs_and_edges()
    print("ok")


if __name__ == "__main__":
    _run_checks()
