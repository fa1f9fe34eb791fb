"""Pull weights into the GPU's L2 cache ahead of the matmul that reads them (decode, small batch).

Why: at batch 1 a decode step is a chain of small kernels, and most of them leave the memory
bus idle. llama-1b's qkv GEMV streams its weights at 2.1 TB/s and o_proj's at 1.4
(`bench_gemv.py`); the rotary, KV store and attention kernels between them read almost nothing.
The copy ceiling is 4.27 TB/s. A prefetch on a side stream, started when the layer starts, can
use that idle bandwidth to load o_proj and the head of gate_up into L2 while the qkv GEMV and
attention run. The later matmuls then read them from L2 instead of HBM.

    l2_prefetch([o_proj.weight, gate_up.weight], max_bytes, sink)   # on a side stream

The loads bypass L1 (`.cg`) and land in L2 with its normal policy. Each program folds
what it read into one int32 (xor), written to `sink` so the loads cannot be optimized away. The
sink's value means nothing; tests check it against the same xor on the host. The prefetch
runs beside the critical path's kernels, so its programs are light and bounded in number.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_PROGRAMS = 128  # per tensor: about one per SM, each light (4 warps, ~40 registers)
BLOCK = 4096  # int32 words per program and iteration (16 KB: 8 vector loads per thread)
# the loads' cache modifier: ".cg" caches in L2 only. NOTE: ptxas rejects ".cg" with an
# eviction priority (".evict_last"), so the lines get L2's normal policy
CACHE_MODIFIER = ".cg"
# NOTE: guesses until measured (bench_throughput --l2-prefetch-config sets all three). The loads
# are not software-pipelined (they feed no dot; checked in the sm_90 PTX), so the bytes in
# flight are NUM_PROGRAMS x BLOCK x 4: 2 MB here, ~2.5 TB/s at ~0.8 µs of memory latency. The
# critical path's kernels compete for the same bus: too many programs would slow them


@triton.jit
def _l2_prefetch_kernel(Src, Sink, num_words, BLOCK_SIZE: tl.constexpr, CACHE: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK_SIZE
    acc = tl.zeros([BLOCK_SIZE], dtype=tl.int32)
    for start in range(pid * BLOCK_SIZE, num_words, step):
        offs = start + tl.arange(0, BLOCK_SIZE)
        acc ^= tl.load(
            Src + offs,
            mask=offs < num_words,
            other=0,
            cache_modifier=CACHE,
        )
    tl.store(Sink + pid, tl.xor_sum(acc, axis=0))


def prefetch_words(tensors: list[torch.Tensor], max_bytes: int) -> list[torch.Tensor]:
    """The int32 views of what l2_prefetch reads: the tensors in order, the last one cut so the
    total stays within max_bytes (whole 4-byte words). Each tensor must be contiguous."""
    views = []
    left = max_bytes // 4
    for t in tensors:
        if left <= 0:
            break
        assert t.is_contiguous(), "l2_prefetch reads contiguous tensors"
        flat = t.view(-1)
        words = flat.numel() * flat.element_size() // 4
        words_view = flat[: words * 4 // flat.element_size()].view(torch.int32)
        take = min(left, words_view.numel())
        views.append(words_view[:take])
        left -= take
    return views


def l2_prefetch(tensors: list[torch.Tensor], max_bytes: int, sink: torch.Tensor) -> None:
    """Read up to max_bytes of `tensors` (in order) through L2. sink: int32, at least
    NUM_PROGRAMS * len(tensors) elements; program p of tensor i writes sink[i * NUM_PROGRAMS + p].
    """
    views = prefetch_words(tensors, max_bytes)
    assert sink.dtype == torch.int32 and sink.numel() >= NUM_PROGRAMS * len(views)
    for i, words in enumerate(views):
        programs = min(NUM_PROGRAMS, triton.cdiv(words.numel(), BLOCK))
        _l2_prefetch_kernel[(programs,)](
            words,
            sink[i * NUM_PROGRAMS :],
            words.numel(),
            BLOCK_SIZE=BLOCK,
            CACHE=CACHE_MODIFIER,
            num_warps=4,
        )
