"""The torch attention backend on long prompts: its attention runs on the CPU's fused (flash)
SDPA kernel, whose memory does not grow with prompt x context as the math kernel's scores do
(a 32k-token prefill: gigabytes), and a step of long prefills is no padded batch."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from batchrun.attention.base import AttentionInputs
from batchrun.attention.torch_backend import MAX_PADDED_SCORES, TorchAttentionBackend
from batchrun.engine.kv_pool import KVPool

HEADS, KV_HEADS, DIM = 4, 2, 16


def step(seq_lens: list[int], extend_lens: list[int]):
    """A backend over a 1-layer fp32 pool holding each request's prefix, and the step's q/k/v."""
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(1, sum(seq_lens) + 1, KV_HEADS, DIM, torch.float32, "cpu")
    pool.k_buffers[0].normal_(generator=gen)
    pool.v_buffers[0].normal_(generator=gen)
    table = torch.zeros(len(seq_lens), max(seq_lens), dtype=torch.int32)
    start, locs = 0, []
    for row, (seq_len, ext) in enumerate(zip(seq_lens, extend_lens)):
        table[row, :seq_len] = torch.arange(start, start + seq_len, dtype=torch.int32)
        locs.append(torch.arange(start + seq_len - ext, start + seq_len))
        start += seq_len
    inputs = AttentionInputs(
        req_pool_indices=torch.arange(len(seq_lens)),
        seq_lens=torch.tensor(seq_lens),
        extend_lens=torch.tensor(extend_lens),
        out_cache_loc=torch.cat(locs),
        seq_lens_cpu=tuple(seq_lens),
        extend_lens_cpu=tuple(extend_lens),
    )
    t = sum(extend_lens)
    q, k, v = (torch.randn(t, n, DIM, generator=gen) for n in (HEADS, KV_HEADS, KV_HEADS))
    backend = TorchAttentionBackend(pool, table)
    backend.prepare(inputs)
    return backend, q, k, v


@pytest.mark.parametrize(
    "seq_lens, extend_lens",
    [([2048], [2048]), ([3000], [512]), ([2048, 700], [2048, 1]), ([40, 9, 30], [1, 1, 30])],
    ids=["prefill", "chunk-over-prefix", "prefill-and-decode", "padded"],
)
def test_attention_runs_on_the_fused_cpu_kernel(seq_lens, extend_lens):
    backend, q, k, v = step(seq_lens, extend_lens)
    expected = backend.forward(q, k, v, 0, DIM**-0.5)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # the math kernel refused
        out = backend.forward(q, k, v, 0, DIM**-0.5)
    torch.testing.assert_close(out, expected)


def test_long_prefills_are_no_padded_batch():
    lens = [4096, 4000]
    assert len(lens) * max(lens) ** 2 > MAX_PADDED_SCORES
    backend, *_ = step(lens, lens)
    assert backend._plan[0] == "loop"
