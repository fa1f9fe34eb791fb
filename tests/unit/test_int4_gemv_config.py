"""kernels/int4_gemv.py's config rule: one row runs on the CUDA-core kernel, split along K by
its rule (llama-8b's matrices as timed in scripts/bench_int4_matmul.py --sweep fma), more rows
on the tensor-core kernel; and kernels/int4_gemv_mma.py's K split."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")


def test_one_row_takes_the_cuda_core_kernel_and_more_the_tensor_cores():
    from batchrun.kernels.int4_gemv import pick_config, pick_dot_config, pick_fma_config

    for n, k, swiglu in ((6144, 4096, False), (28672, 4096, True), (4096, 14336, False)):
        assert pick_config(1, n, k, swiglu) == pick_fma_config(n, k, swiglu)
        assert pick_config(1, n, k, swiglu).fma
        for m in (2, 16):
            assert pick_config(m, n, k, swiglu) == pick_dot_config(m, n, k, swiglu)
            assert not pick_config(m, n, k, swiglu).fma


def test_fma_splits_of_llama_8b():
    """qkv, o and down in 32 K slices of one 128-row tile or more, the SwiGLU gate_up (56
    column tiles a half) in 8."""
    from batchrun.kernels.int4_gemv import pick_fma_config

    assert pick_fma_config(6144, 4096).split_k == 32
    assert pick_fma_config(4096, 4096).split_k == 32
    assert pick_fma_config(4096, 14336).split_k == 32
    assert pick_fma_config(28672, 4096, swiglu=True).split_k == 8
    assert pick_fma_config(28672, 4096).block_k == 128


def test_mma_splits_of_llama_8b():
    """kernels/int4_gemv_mma.py's K slices for llama-8b's matrices at group 128 (128-deep
    chunks): the best of `bench_int4_matmul.py --m 1 --sweep mma` on the H100 for each (qkv,
    o and down 16, the SwiGLU gate_up's 14,336 rows a half 4)."""
    pytest.importorskip("triton.experimental.gluon")
    from batchrun.kernels.int4_gemv_mma import pick_split

    assert pick_split(6144, 4096, 128) == 16
    assert pick_split(4096, 4096, 128) == 16
    assert pick_split(14336, 4096, 128) == 4
    assert pick_split(4096, 14336, 128) == 16
