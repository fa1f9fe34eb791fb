"""Attention tiles that fit the GPU's shared memory.

An attention program holds in shared memory its query tile, its softmax weights' tile (the p @ v
operand) and, for each pipeline stage, one K and one V block:

    bytes = q_rows * D * q_bytes + q_rows * BLOCK_N * q_bytes + stages * 2 * BLOCK_N * D * kv_bytes

with D the head dim's power of two. At head dim 512 the extend kernel's defaults (64 query rows,
BLOCK_N 64, 2 stages) need 327,680 bytes; an H100 or H200 block gets at most 232,448. The rule
keeps the defaults where they fit and otherwise halves BLOCK_N down to 32, then drops stages
down to 1, then halves BLOCK_N down to 16: the query rows stay (they set how often K and V are
read), and fewer stages cost less than a narrower block until the block is narrow.

The limit is the device's own (Triton's driver: the opt-in maximum a block may ask for): the
attention backend reads it once and passes it to every launch; on CPU tensors (Triton's
interpreter) there is none.
"""

from __future__ import annotations

import torch
import triton

MIN_BLOCK_N = 16  # tl.dot's smallest operand side
HALVE_FIRST_TO = 32  # BLOCK_N halves down to this before the stages drop


def tile_bytes(
    q_rows: int, head_dim: int, block_n: int, num_stages: int, q_bytes: int, kv_bytes: int
) -> int:
    """Shared memory bytes of one program's tiles (the module docstring's sum)."""
    block_d = triton.next_power_of_2(head_dim)
    q_tiles = q_rows * block_d * q_bytes + q_rows * block_n * q_bytes
    return q_tiles + num_stages * 2 * block_n * block_d * kv_bytes


def fit_kv_tiles(
    q_rows: int,
    head_dim: int,
    block_n: int,
    num_stages: int,
    q_bytes: int,
    kv_bytes: int,
    limit: int | None,
) -> tuple[int, int]:
    """(BLOCK_N, stages) at most the given ones whose tiles fit `limit` bytes (None: no limit).
    The smallest tiles are returned where nothing fits: Triton's compile error then names the
    shortfall."""
    if limit is None:
        return block_n, num_stages
    while tile_bytes(q_rows, head_dim, block_n, num_stages, q_bytes, kv_bytes) > limit:
        if block_n > HALVE_FIRST_TO:
            block_n //= 2
        elif num_stages > 1:
            num_stages -= 1
        elif block_n > MIN_BLOCK_N:
            block_n //= 2
        else:
            break
    return block_n, num_stages


def shared_memory_limit(device: torch.device) -> int | None:
    """The shared memory bytes a program may use on `device` (None on a CPU: no limit)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
