"""The prefill-only tasks on the GPU: packed variable-length attention (torch's varlen_attn) equals
the per-sequence reference in each of its modes, and a tiny embedder, cross-encoder and reward
model in bf16 on CUDA give what they give in fp32 on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchrun.pooling.model import load_pooling_model
from batchrun.pooling.varlen import varlen_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pooling_models import TEXTS, make_decoder, make_encoder  # noqa: E402

SEQ_LENS = (1, 7, 64, 300, 33, 128, 2)


@pytest.mark.parametrize(
    "causal,half_window,window",
    [(False, 0, 0), (True, 0, 0), (True, 0, 16), (False, 8, 0)],
)
@pytest.mark.parametrize("num_kv", [8, 2])
def test_varlen_attention_equals_the_reference(causal, half_window, window, num_kv):
    torch.manual_seed(0)
    t = sum(SEQ_LENS)
    q = torch.randn(t, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, num_kv, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, num_kv, 64, device="cuda", dtype=torch.bfloat16)
    got = varlen_attention(q, k, v, SEQ_LENS, 0.125, causal, half_window, window)
    ref = varlen_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), SEQ_LENS, 0.125,
                           causal, half_window, window)  # fmt: skip
    torch.testing.assert_close(got.float().cpu(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kind", ["bert", "modernbert", "qwen3"])
def test_bf16_on_cuda_matches_fp32_on_the_cpu(tmp_path, kind):
    if kind == "qwen3":
        make_decoder(tmp_path, kind, "base")
    else:
        make_encoder(tmp_path, kind)
    cpu = load_pooling_model(tmp_path)
    gpu = load_pooling_model(tmp_path, dtype=torch.bfloat16, device="cuda")
    rows = [cpu.tokenize(t) for t in TEXTS]
    a = cpu.embed(rows, pooling="mean", normalize=True)
    b = gpu.embed(rows, pooling="mean", normalize=True).cpu()
    assert F.cosine_similarity(a, b).min() >= 0.99


@pytest.mark.parametrize("kind", ["xlm-roberta", "gemma3"])
def test_heads_in_bf16_on_cuda(tmp_path, kind):
    if kind == "gemma3":
        make_decoder(tmp_path, kind, "classify", num_labels=2)
    else:
        make_encoder(tmp_path, kind, num_labels=1)
    cpu = load_pooling_model(tmp_path)
    gpu = load_pooling_model(tmp_path, dtype=torch.bfloat16, device="cuda")
    pairs = list(zip(TEXTS[:8], TEXTS[8:], strict=True))
    rows = [cpu.tokenize(a, b) for a, b in pairs]
    torch.testing.assert_close(
        gpu.classify_logits(rows).cpu(), cpu.classify_logits(rows), atol=5e-2, rtol=5e-2
    )


@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize("num_kv", [8, 2])
def test_shared_prefix_attention_equals_the_reference(window, num_kv):
    """FlashAttention's bottom-right causal mask over a segment's ancestors' and own keys equals
    the CPU reference of pooling/shared_prefix.py."""
    from batchrun.pooling.shared_prefix import plan_shared_prefixes, prefix_attention

    gen = torch.Generator().manual_seed(0)
    instr = tuple(torch.randint(0, 50, (40,), generator=gen).tolist())
    seqs = []
    for _ in range(6):
        query = tuple(torch.randint(0, 50, (int(torch.randint(1, 60, (1,))),),
                                    generator=gen).tolist())  # fmt: skip
        for _ in range(5):
            doc = tuple(torch.randint(0, 50, (int(torch.randint(1, 200, (1,))),),
                                      generator=gen).tolist())  # fmt: skip
            seqs.append(instr + query + doc)
    plan = plan_shared_prefixes(seqs)
    assert plan.kv_rows is not None
    t = plan.num_tokens
    q = torch.randn(t, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, num_kv, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, num_kv, 64, device="cuda", dtype=torch.bfloat16)
    rows = torch.tensor(plan.kv_rows)
    got = prefix_attention(q, k, v, plan, rows.cuda(), 0.125, window)
    ref = prefix_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), plan, rows, 0.125,
                           window)  # fmt: skip
    torch.testing.assert_close(got.float().cpu(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_shared_prefix_steps_on_cuda_match_unshared_fp32_on_the_cpu(tmp_path, kind):
    """A decoder classifier's rows behind one long instruction: the CUDA bf16 engine computes the
    instruction once per step (gemma3: through its sliding layers) and gives the CPU's unshared
    fp32 logits."""
    from batchrun.pooling.engine import PoolingEngine, PoolRequest, TaskOptions

    make_decoder(tmp_path, kind, "classify", num_labels=2)
    cpu = load_pooling_model(tmp_path)
    gpu = load_pooling_model(tmp_path, dtype=torch.bfloat16, device="cuda")
    instruction = "Instruct: judge whether the passage answers the question well\nQuery: "
    rows = [cpu.tokenize(t, prompt=instruction) for t in TEXTS]
    want = cpu.classify_logits(rows)
    engine = PoolingEngine(gpu, TaskOptions("classify"), max_step_tokens=100_000)
    engine.add([PoolRequest(i, r) for i, r in enumerate(rows)])
    results = engine.step()
    assert not engine.has_work and sum(r.num_shared for r in results) >= 15 * 60
    got = torch.stack([r.value for r in sorted(results, key=lambda r: r.rid)]).float()
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
