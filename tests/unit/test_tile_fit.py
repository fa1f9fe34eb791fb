"""kernels/tile_fit.py's rule: the attention kernels' tiles at Gemma 4's head dims within an
H100's shared memory, the defaults kept where they fit. The figures Triton asks for come from
compiling the kernels for sm_90 (the module docstring)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from batchrun.kernels import decode_attention as decode  # noqa: E402
from batchrun.kernels.extend_attention import (  # noqa: E402
    DEFAULT_BLOCK_N,
    DEFAULT_NUM_STAGES,
    DEFAULT_PACKED_ROWS,
)
from batchrun.kernels.tile_fit import SCRATCH, fit_kv_tiles, tile_bytes  # noqa: E402

H100 = 232448  # the bytes a program may ask for on an H100 (and an H200)


@pytest.mark.parametrize("head_dim,asked", [(256, 163840), (512, 327680)])
def test_the_sum_is_what_the_extend_kernel_asks_for(head_dim, asked):
    need = tile_bytes(DEFAULT_PACKED_ROWS, head_dim, DEFAULT_BLOCK_N, DEFAULT_NUM_STAGES, 2, 2)
    assert need == asked + SCRATCH


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_extend_defaults_stay_where_they_fit(head_dim):
    args = (DEFAULT_PACKED_ROWS, head_dim, DEFAULT_BLOCK_N, DEFAULT_NUM_STAGES, 2, 2, H100)
    assert fit_kv_tiles(*args) == (DEFAULT_BLOCK_N, DEFAULT_NUM_STAGES)


@pytest.mark.parametrize("kv_bytes", [1, 2, 4])
@pytest.mark.parametrize("q_rows", [16, 32, 64])  # D 512 packs at most 64 rows
def test_head_dim_512_fits(q_rows, kv_bytes):
    q_bytes = 4 if kv_bytes == 4 else 2
    block_n, stages = fit_kv_tiles(q_rows, 512, 64, 2, q_bytes, kv_bytes, H100)
    assert block_n >= 16 and stages >= 1
    assert tile_bytes(q_rows, 512, block_n, stages, q_bytes, kv_bytes) <= H100


def test_bf16_extend_at_head_dim_512_halves_block_n_and_keeps_stages():
    assert fit_kv_tiles(64, 512, 64, 2, 2, 2, H100) == (32, 2)


def test_no_limit_keeps_the_given_tiles():
    assert fit_kv_tiles(64, 512, 64, 2, 2, 2, None) == (64, 2)


@pytest.mark.parametrize("kv_bytes,block_n", [(2, decode.DEFAULT_BLOCK_N), (1, decode.FP8_BLOCK_N)])
@pytest.mark.parametrize("head_dim", [256, 512])
def test_decode_defaults_stay_at_gemma4_head_dims(head_dim, kv_bytes, block_n):
    """The decode kernel (16 query rows, one K / V buffer: 149,760 bytes at head dim 512 in
    bf16) keeps its tiles at Gemma 4's head dims in bf16 and with a float8 pool; fp32 at 512
    halves BLOCK_N."""
    stages = decode.DEFAULT_NUM_STAGES
    fitted = fit_kv_tiles(16, head_dim, block_n, stages, 2, kv_bytes, H100, pipelined=False)
    assert fitted == (block_n, stages)
    fp32 = fit_kv_tiles(16, 512, 64, stages, 4, 4, H100, pipelined=False)
    assert fp32 == (32, stages) and tile_bytes(16, 512, 32, 1, 4, 4) <= H100
