"""Host lists -> tensors for the step path (batchrun/engine/staging.py): the same values and dtypes
as torch.tensor, on the CPU (tests/gpu/test_staging_gpu.py covers the pinned ring on CUDA)."""

from __future__ import annotations

import pytest
import torch

from batchrun.engine.staging import RING_SLOTS, PinnedStaging, host_tensor


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
@pytest.mark.parametrize("values", [[], [0], [3, -1, 2**31 - 1], list(range(5000))])
def test_host_tensor_equals_torch_tensor(dtype, values):
    if dtype == torch.float32:
        values = [v / 3 for v in values]
    out = host_tensor(values, dtype)
    ref = torch.tensor(values, dtype=dtype)
    assert out.dtype == ref.dtype and torch.equal(out, ref)


def test_host_tensor_int64_extremes_and_other_dtypes():
    values = [-(2**63), 2**63 - 1, 0]
    assert torch.equal(host_tensor(values, torch.int64), torch.tensor(values))
    assert torch.equal(host_tensor([1, 0], torch.bool), torch.tensor([True, False]))


def test_staging_on_cpu_makes_independent_tensors():
    staging = PinnedStaging(torch.device("cpu"))
    outs = [staging.to_device(list(range(i, i + 7)), torch.int64) for i in range(RING_SLOTS + 3)]
    for i, out in enumerate(outs):
        assert out.tolist() == list(range(i, i + 7))


def test_pack_to_device_views_are_16_byte_aligned():
    """ModelRunner._pack_to_device: one copy for a step's int arrays, each view holding its
    values and starting 16-byte aligned whatever the lengths before it (Triton compiles a
    variant per pointer alignment: unaligned views made variants compile mid-run)."""
    from types import SimpleNamespace

    from batchrun.engine.model_runner import ModelRunner

    runner = SimpleNamespace(staging=PinnedStaging(torch.device("cpu")))
    arrays = [[1, 2, 3], [], [4], torch.tensor([5, 6]), [7, 8, 9, 10, 11]]
    views = ModelRunner._pack_to_device(runner, *arrays)
    assert [v.tolist() for v in views] == [[1, 2, 3], [], [4], [5, 6], [7, 8, 9, 10, 11]]
    assert all(v.dtype == torch.int64 and v.data_ptr() % 16 == 0 for v in views)
