"""The pinned staging ring on CUDA: every upload arrives intact while later ones reuse and grow
the ring's buffers, with no sync between them (the copies are in flight together)."""

from __future__ import annotations

import random

import pytest
import torch

from batchrun.engine.staging import RING_SLOTS, PinnedStaging

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_ring_uploads_arrive_intact():
    rng = random.Random(0)
    staging = PinnedStaging(torch.device("cuda"), initial_bytes=64)
    sent, outs = [], []
    for _ in range(5 * RING_SLOTS):
        n = rng.choice([1, 7, 300, 5000, 70000])  # grows the buffers while copies are in flight
        dtype = rng.choice([torch.int64, torch.int32, torch.float32])
        values = [rng.randrange(-(2**31), 2**31) for _ in range(n)]
        if dtype == torch.float32:
            values = [v / 7 for v in values]
        sent.append(torch.tensor(values, dtype=dtype))
        outs.append(staging.to_device(values, dtype))
    torch.cuda.synchronize()
    for ref, out in zip(sent, outs):
        assert out.is_cuda and out.dtype == ref.dtype and torch.equal(out.cpu(), ref)
