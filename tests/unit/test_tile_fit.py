"""kernels/tile_fit.py's rule: the extend kernel's tiles at Gemma 4's head dims within an H100's
shared memory, the defaults kept where they fit."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from batchrun.kernels import decode_attention as decode  # noqa: E402
from batchrun.kernels.extend_attention import (  # noqa: E402
    DEFAULT_BLOCK_N,
    DEFAULT_NUM_STAGES,
    DEFAULT_PACKED_ROWS,
)
from batchrun.kernels.tile_fit import fit_kv_tiles, tile_bytes  # noqa: E402

H100 = 232448  # the bytes a program may ask for on an H100 (and an H200)


def test_head_dim_512_defaults_exceed_the_h100():
    need = tile_bytes(DEFAULT_PACKED_ROWS, 512, DEFAULT_BLOCK_N, DEFAULT_NUM_STAGES, 2, 2)
    # Triton asks for 327,680 bytes at these tiles (q and the stages' K and V); the rule's sum
    # holds the softmax weights' tile too
    assert need >= 327680 > H100


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_defaults_stay_where_they_fit(head_dim):
    args = (DEFAULT_PACKED_ROWS, head_dim, DEFAULT_BLOCK_N, DEFAULT_NUM_STAGES, 2, 2, H100)
    assert fit_kv_tiles(*args) == (DEFAULT_BLOCK_N, DEFAULT_NUM_STAGES)


@pytest.mark.parametrize("kv_bytes", [1, 2, 4])
@pytest.mark.parametrize("q_rows", [16, 32, 64])  # D 512 packs at most 64 rows
def test_head_dim_512_fits(q_rows, kv_bytes):
    q_bytes = 4 if kv_bytes == 4 else 2
    block_n, stages = fit_kv_tiles(q_rows, 512, 64, 2, q_bytes, kv_bytes, H100)
    assert block_n >= 16 and stages >= 1
    assert tile_bytes(q_rows, 512, block_n, stages, q_bytes, kv_bytes) <= H100


def test_bf16_head_dim_512_halves_block_n_and_keeps_stages():
    assert fit_kv_tiles(64, 512, 64, 2, 2, 2, H100) == (32, 2)


def test_no_limit_keeps_the_given_tiles():
    assert fit_kv_tiles(64, 512, 64, 2, 2, 2, None) == (64, 2)


@pytest.mark.parametrize("kv_bytes,block_n", [(2, decode.DEFAULT_BLOCK_N), (1, decode.FP8_BLOCK_N)])
def test_decode_defaults_stay_at_head_dim_256(kv_bytes, block_n):
    """The decode kernel's tiles (16 query rows, 3 stages) at Gemma 4's sliding head dim, bf16
    and a float8 pool, fit as they are; at 512 they shrink under the H100's limit."""
    stages = decode.DEFAULT_NUM_STAGES
    assert fit_kv_tiles(16, 256, block_n, stages, 2, kv_bytes, H100) == (block_n, stages)
    fitted = fit_kv_tiles(16, 512, block_n, stages, 2, kv_bytes, H100)
    assert fitted == (block_n // 2, stages)
    assert tile_bytes(16, 512, *fitted, 2, kv_bytes) <= H100
