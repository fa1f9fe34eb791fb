"""Long documents on the GPU: the Triton backend's extend attention (KV store + kernel) against
torch's SDPA from 4k to 128k tokens, with and without a cached prefix, and a 128k-token prompt
on dummy llama-8b (Llama 3.1's context) that completes with the default settings, with the
bf16 and the FP8 KV cache.

    pytest tests/gpu/test_long_context_gpu.py -v -s
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from batchrun.attention.base import AttentionInputs  # noqa: E402
from batchrun.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from batchrun.config import EngineConfig, KernelPlan  # noqa: E402
from batchrun.engine.kv_pool import KVPool  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import benchlib  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = "cuda"
H, KV, D = 32, 8, 128  # llama-8b's attention
BACKEND_KERNELS = KernelPlan(attention="triton", triton_ops=True, pdl=False)
# max |out - ref| / max |ref|, bf16 against bf16 SDPA (fp32 accumulation in both)
TOL = 2e-2


def extend_step(extend_len: int, prefix_len: int, seed: int = 0):
    """One request of extend_len new tokens over a prefix_len-token prefix already in a pool
    (shuffled slots); its q/k/v in bf16."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    seq_len = prefix_len + extend_len
    pool = KVPool(1, seq_len + 7, KV, D, torch.bfloat16, DEV)
    for buf in (pool.k_buffers[0], pool.v_buffers[0]):
        buf.copy_(torch.randn(buf.shape, generator=gen, device=DEV))
    slots = torch.randperm(seq_len + 7, generator=gen, device=DEV)[:seq_len]
    table = torch.zeros(2, -(-seq_len // 16) * 16, dtype=torch.int32, device=DEV)
    table[0, :seq_len] = slots.int()
    inputs = AttentionInputs(
        req_pool_indices=torch.zeros(1, dtype=torch.int64, device=DEV),
        seq_lens=torch.tensor([seq_len], device=DEV),
        extend_lens=torch.tensor([extend_len], device=DEV),
        out_cache_loc=slots[prefix_len:].long(),
        seq_lens_cpu=(seq_len,),
        extend_lens_cpu=(extend_len,),
    )
    # q scaled up: sharper softmaxes than N(0, 1) scores over 128k keys give
    q = 3 * torch.randn(extend_len, H, D, generator=gen, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(extend_len, KV, D, generator=gen, device=DEV, dtype=torch.bfloat16)
            for _ in range(2))  # fmt: skip
    return pool, table, slots, inputs, q, k, v


def sdpa_reference(pool, slots, q, prefix_len: int) -> torch.Tensor:
    """SDPA over the request's keys in order (contiguous), bottom-right causal: [E, H, D]."""
    from torch.nn.attention.bias import causal_lower_right

    extend_len, seq_len = q.shape[0], slots.shape[0]
    k_buf, v_buf = pool.buffers(0)
    keys = k_buf[slots.long()].transpose(0, 1).repeat_interleave(H // KV, 0)[None]
    values = v_buf[slots.long()].transpose(0, 1).repeat_interleave(H // KV, 0)[None]
    query = q.transpose(0, 1)[None]  # [1, H, E, D]
    if prefix_len == 0:
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=D**-0.5)
    else:
        mask = causal_lower_right(extend_len, seq_len)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=D**-0.5)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize(
    "extend_len, prefix_len",
    [(4096, 0), (16384, 0), (65536, 0), (131072, 0), (4096, 12288), (16384, 114688),
     (4096, 126976)],
    ids=lambda n: f"{n // 1024}k",
)  # fmt: skip
def test_extend_attention_against_sdpa(extend_len, prefix_len):
    pool, table, slots, inputs, q, k, v = extend_step(extend_len, prefix_len)
    backend = TritonAttentionBackend(pool, table, BACKEND_KERNELS)
    backend.prepare(inputs)
    out = torch.full((extend_len, H, D), float("nan"), device=DEV, dtype=torch.bfloat16)
    backend.forward(q, k, v, 0, D**-0.5, out=out)
    ref = sdpa_reference(pool, slots, q, prefix_len)
    assert not out.isnan().any()
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err < TOL, (extend_len, prefix_len, float(err))


@pytest.fixture(scope="module")
def llama8b_128k(tmp_path_factory):
    return benchlib.write_model_dir("llama-8b", tmp_path_factory.mktemp("m"), long_context=True)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_a_128k_prompt_on_llama_8b_completes_with_the_defaults(llama8b_128k, kv_cache_dtype):
    """The whole context, 131,056 prompt tokens and 16 new ones, on dummy llama-8b with the
    default settings (KV pool, chunked prefill, graphs, overlap): it completes without running
    out of memory, next to a short request that decodes meanwhile."""
    from batchrun.engine.engine import Engine

    gc.collect()  # the other parameter's engine (its pool takes most of the GPU)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    engine = Engine(
        EngineConfig(model=str(llama8b_128k), load_format="dummy", device="cuda",
                     kv_cache_dtype=kv_cache_dtype)
    )  # fmt: skip
    assert engine.context_len == 131072
    assert engine.num_kv_slots >= 131072
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    long = torch.randint(1000, 30000, (131072 - 16,), generator=g).tolist()
    requests = [
        GenerateRequest("short", [1000, 1001, 1002], params),
        GenerateRequest("long", long, params),
    ]
    results = {r.rid: r for r in engine.generate(requests)}
    for rid in ("short", "long"):
        assert results[rid].completion_tokens == 16 and results[rid].finish_reason == "length"
    assert results["long"].prompt_tokens == 131072 - 16
    peak = torch.cuda.max_memory_allocated() / 2**30
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    print(f"\n{kv_cache_dtype}: KV pool {engine.num_kv_slots:,} tokens, peak {peak:.1f} GiB "
          f"of {total:.1f}")  # fmt: skip
    del engine, results
    gc.collect()
    torch.cuda.empty_cache()
