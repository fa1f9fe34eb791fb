"""Gemma 4 on CUDA: the Triton decode and extend kernels at head dims 256 and 512 with and
without a window, over many lengths, against the torch reference (fp32); the Triton backend over
a pool whose layers differ in head dim and KV heads (eager and CUDA-graph decode); and the tiny
Gemma 4 models on the engine with the default kernels (Triton attention, CUDA graphs, overlap;
the MoE's experts on the torch loop) against transformers' greedy tokens in fp32; the MoE on the
fused GELU-tanh experts in CUDA graphs against eager."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from batchrun.kernels.extend_attention import extend_attention_fwd  # noqa: E402
from test_kernels import BACKEND_KERNELS, DEV, assert_close, decode, make_batch, ragged  # noqa: E402
from test_sliding_window_gpu import reference  # noqa: E402

from batchrun.attention.base import AttentionInputs  # noqa: E402
from batchrun.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from batchrun.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from batchrun.config import EngineConfig, KernelPlan  # noqa: E402
from batchrun.engine.kv_pool import KVPool  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("head_dim", [256, 512])
@pytest.mark.parametrize("window", [0, 64, 1024])
@pytest.mark.parametrize("batch_size", [1, 7, 64], ids=["b1", "b7", "b64"])
def test_decode_at_gemma4_head_dims(head_dim, window, batch_size):
    rng = random.Random(head_dim + window + batch_size)
    seq_lens = [3000] if batch_size == 1 else [1, 33, *ragged(rng, batch_size - 2, 1, 2500)]
    heads = (16, 8) if head_dim == 256 else (16, 2)  # the 31B's sliding / full layers
    pool, table, inputs, q, k, v = make_batch(
        seq_lens, [1] * batch_size, *heads, head_dim, torch.bfloat16
    )
    ref = reference(pool, table, inputs, q, k, v, 1.0, window)
    for splits in (1, 5, 16):
        out = decode(pool, table, inputs, q, splits, 1.0, window=window)
        assert_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("head_dim", [256, 512])
@pytest.mark.parametrize("window", [0, 17, 512])
def test_extend_at_gemma4_head_dims(head_dim, window):
    prefix_lens, extend_lens = [0, 700, 3, 1200, 64, 0], [333, 65, 129, 1, 200, 1000]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    heads = (16, 8) if head_dim == 256 else (16, 2)
    pool, table, inputs, q, k, v = make_batch(seq_lens, extend_lens, *heads, head_dim,
                                              torch.bfloat16)  # fmt: skip
    ref = reference(pool, table, inputs, q, k, v, 1.0, window)
    ext = inputs.extend_lens
    out = torch.full_like(q, float("nan"))
    extend_attention_fwd(
        q, *pool.buffers(0), out, table, inputs.req_pool_indices, inputs.seq_lens, ext,
        torch.cumsum(ext, 0) - ext, max(extend_lens), 1.0, window=window,
    )  # fmt: skip
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("head_dim", [256, 512])
@pytest.mark.parametrize("window", [0, 33, 1024])
@pytest.mark.parametrize("heads", [(16, 2), (32, 4), (8, 8)], ids=["g8", "g8x4", "mha"])
def test_extend_many_lengths_within_shared_memory(head_dim, window, heads):
    """Ragged prefixes and chunks (a 4,096-token prefill among them), GQA groups of 8 and none:
    the tiles fit the device's shared memory at head dim 512 (kernels/tile_fit.py)."""
    rng = random.Random(head_dim * 7 + window + heads[0])
    extend_lens = [1, 2, 15, 16, 17, 63, 64, 65, 4096, *ragged(rng, 6, 1, 900)]
    prefix_lens = [0, 5, 0, 1000, 31, 0, 2048, 7, 0, *ragged(rng, 6, 0, 1500)]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool, table, inputs, q, k, v = make_batch(seq_lens, extend_lens, *heads, head_dim,
                                              torch.bfloat16)  # fmt: skip
    ref = reference(pool, table, inputs, q, k, v, head_dim**-0.5, window)
    ext = inputs.extend_lens
    out = torch.full_like(q, float("nan"))
    extend_attention_fwd(
        q, *pool.buffers(0), out, table, inputs.req_pool_indices, inputs.seq_lens, ext,
        torch.cumsum(ext, 0) - ext, max(extend_lens), head_dim**-0.5, window=window,
    )  # fmt: skip
    assert_close(out, ref, torch.bfloat16)


def _inputs(table, seq_lens, extend_lens, slots):
    rows = torch.arange(len(seq_lens), device=DEV)
    return AttentionInputs(
        req_pool_indices=rows,
        seq_lens=torch.tensor(seq_lens, device=DEV),
        extend_lens=torch.tensor(extend_lens, device=DEV),
        out_cache_loc=slots,
        seq_lens_cpu=tuple(seq_lens),
        extend_lens_cpu=tuple(extend_lens),
    )


def test_triton_backend_over_layers_of_two_shapes():
    """Layer 0: 8 KV heads of 256, window 64; layer 1: 2 KV heads of 512, the whole context;
    a shared layer reads layer 1's KV (k, v None). Decode and extend against the torch backend."""
    shapes = ((8, 256), (2, 512))
    seq_lens, num = [40, 300, 1000, 7], 2048
    table = torch.zeros((len(seq_lens) + 1, 2048), dtype=torch.int32, device=DEV)
    pools = [KVPool(2, num, 0, 0, torch.float32, DEV, shapes=shapes) for _ in range(2)]
    used = 0
    for b, n in enumerate(seq_lens):
        table[b, :n] = torch.arange(used, used + n, dtype=torch.int32, device=DEV)
        used += n
    for layer, (kv, d) in enumerate(shapes):
        init = torch.randn(num + 1, kv, d, device=DEV)
        for pool in pools:
            pool.k_buffers[layer].copy_(init)
            pool.v_buffers[layer].copy_(init.flip(0))
    triton = TritonAttentionBackend(pools[0], table, BACKEND_KERNELS)
    torch_ref = TorchAttentionBackend(pools[1], table)
    for extend in ([1, 1, 1, 1], [5, 40, 1, 7]):
        slots = torch.cat([table[b, n - e : n] for b, (n, e) in enumerate(zip(seq_lens, extend))])
        inputs = _inputs(table, seq_lens, extend, slots.long())
        triton.prepare(inputs)
        torch_ref.prepare(inputs)
        t = sum(extend)
        for layer, (kv, d), window in ((0, shapes[0], 64), (1, shapes[1], 0)):
            q = torch.randn(t, 16, d, device=DEV)
            k, v = torch.randn(t, kv, d, device=DEV), torch.randn(t, kv, d, device=DEV)
            want = torch_ref.forward(q, k, v, layer, 1.0, window=window)
            got = triton.forward(q, k, v, layer, 1.0, window=window)
            torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
            shared_want = torch_ref.forward(q, None, None, layer, 1.0, window=window)
            shared_got = triton.forward(q, None, None, layer, 1.0, window=window)
            torch.testing.assert_close(shared_got, shared_want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("kind", ["dense", "moe", "e-model"])
def test_tiny_gemma4_equals_transformers(kind, tmp_path):
    from gemma4_models import make_gemma4
    from tiny_models import random_prompts

    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    hf = make_gemma4(kind, tmp_path).cuda()
    # fp32 parity: the experts on the torch loop (the fused experts' fp32 runs on TF32)
    kernels = KernelPlan(moe="torch", cuda_graph_max_bs=0) if kind == "moe" else KernelPlan()
    engine = Engine(EngineConfig(model=str(tmp_path), device="cuda", dtype="float32",
                                 kv_budget=8192), kernels=kernels)  # fmt: skip
    assert engine.kernels.attention == "triton"
    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(8, seed=5, min_len=4, max_len=60)
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    got = {r.rid: r.output_ids for r in engine.generate(reqs)}
    engine.check_integrity()
    for i, prompt in enumerate(prompts):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(32):
                logits = hf(torch.tensor([ids], device="cuda")).logits[0, -1]
                ids.append(int(logits.argmax()))
        assert got[str(i)] == ids[len(prompt) :], i


def test_tiny_gemma4_moe_on_the_fused_experts(tmp_path):
    """The MoE model's default plan: the fused GELU-tanh experts with CUDA graphs; greedy tokens
    equal the same experts run eager."""
    from gemma4_models import make_gemma4
    from tiny_models import random_prompts

    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    make_gemma4("moe", tmp_path)
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(8, seed=6, min_len=4, max_len=60)
    outs = []
    for kernels in (KernelPlan(), KernelPlan(cuda_graph_max_bs=0)):
        engine = Engine(EngineConfig(model=str(tmp_path), device="cuda", dtype="float32",
                                     kv_budget=8192), kernels=kernels)  # fmt: skip
        assert engine.kernels.moe == "triton"
        reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
        outs.append({r.rid: r.output_ids for r in engine.generate(reqs)})
        engine.check_integrity()
        del engine
    assert outs[0] == outs[1]


def test_host_gather_reads_a_pinned_table_on_the_gpu():
    """kernels/host_gather.py: rows of a pinned host table by CUDA ids equal the same table's
    rows on the GPU (bf16, E2B's row width), eager and in a CUDA graph replayed on other ids."""
    from batchrun.kernels.host_gather import gather_rows

    width = 35 * 256
    table = torch.randn(4096, width, dtype=torch.bfloat16).pin_memory()
    on_gpu = table.cuda()
    ids = torch.randint(0, 4096, (300,), device=DEV)
    assert torch.equal(gather_rows(table, ids, 16.0), on_gpu[ids] * 16.0)
    static = ids[:64].clone()
    gather_rows(table, static, 16.0)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gather_rows(table, static, 16.0)
    static.copy_(ids[100:164])
    graph.replay()
    assert torch.equal(out, on_gpu[ids[100:164]] * 16.0)


def test_tiny_e_model_with_the_per_layer_table_on_the_host(tmp_path):
    """The E-model with its per-layer table in pinned host memory gives the greedy tokens of the
    table on the GPU (CUDA graphs, overlap), and the table holds no GPU memory."""
    from gemma4_models import make_gemma4
    from tiny_models import random_prompts

    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    make_gemma4("e-model", tmp_path)
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(8, seed=7, min_len=4, max_len=60)
    outs = []
    for where in ("device", "host"):
        config = EngineConfig(model=str(tmp_path), device="cuda", dtype="float32", kv_budget=8192)
        engine = Engine(config, kernels=KernelPlan(per_layer_table=where))
        assert engine.kernels.per_layer_table == where
        table = engine.runner.model.embed_tokens_per_layer
        assert table.is_cuda == (where == "device") and (where == "device" or table.is_pinned())
        reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
        outs.append({r.rid: r.output_ids for r in engine.generate(reqs)})
        engine.check_integrity()
        del engine
    assert outs[0] == outs[1]
