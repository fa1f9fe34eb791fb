"""Attention tiles that fit the GPU's shared memory.

An attention program holds in shared memory its query tile and, for each K / V buffer, one K and
one V block of BLOCK_N tokens, plus a little scratch for its reductions:

    bytes = q_rows * D * q_bytes + buffers * 2 * BLOCK_N * D * kv_bytes + SCRATCH

with D the head dim's power of two. The extend kernel's loop is software-pipelined, one buffer a
stage; the decode kernel's loop holds one buffer whatever its stages. Compiled for sm_90
(`scripts/check_kernels_compile.py`'s compile-only driver, bf16), the extend kernel asks for
163,840 bytes at head dim 256 and 327,680 at 512 (64 query rows, BLOCK_N 64, 2 stages), the
decode kernel for 149,760 at 512 (16 rows, BLOCK_N 64): the sum without its scratch. An H100 or
H200 block gets at most 232,448. fp32 tiles (the tests' dtype) hold less than the sum says,
so there the rule may shrink tiles that would fit.

The rule keeps the given tiles where they fit and otherwise halves BLOCK_N down to 32, then
drops pipelined stages down to 1, then halves BLOCK_N down to 16: the query rows stay (they set
how often K and V are read), and fewer stages cost less than a narrower block until the block
is narrow.

The limit is the device's own (Triton's driver: the opt-in maximum a block may ask for): the
attention backend reads it once and passes it to every launch; on CPU tensors (Triton's
interpreter) there is none.
"""

from __future__ import annotations

import torch
import triton

MIN_BLOCK_N = 16  # tl.dot's smallest operand side
HALVE_FIRST_TO = 32  # BLOCK_N halves down to this before the stages drop
SCRATCH = 4096  # the reductions' and barriers' shared memory beside the tiles


def tile_bytes(
    q_rows: int, head_dim: int, block_n: int, buffers: int, q_bytes: int, kv_bytes: int
) -> int:
    """Shared memory bytes of one program's tiles (the module docstring's sum)."""
    block_d = triton.next_power_of_2(head_dim)
    return q_rows * block_d * q_bytes + buffers * 2 * block_n * block_d * kv_bytes + SCRATCH


def fit_kv_tiles(
    q_rows: int,
    head_dim: int,
    block_n: int,
    num_stages: int,
    q_bytes: int,
    kv_bytes: int,
    limit: int | None,
    pipelined: bool = True,
) -> tuple[int, int]:
    """(BLOCK_N, stages) at most the given ones whose tiles fit `limit` bytes (None: no limit).
    pipelined: one K / V buffer a stage (the extend kernel); False: one buffer (the decode
    kernel). The smallest tiles are returned where nothing fits: Triton's launch error then
    names the shortfall."""
    if limit is None:
        return block_n, num_stages

    def need() -> int:
        buffers = num_stages if pipelined else 1
        return tile_bytes(q_rows, head_dim, block_n, buffers, q_bytes, kv_bytes)

    while need() > limit:
        if block_n > HALVE_FIRST_TO:
            block_n //= 2
        elif pipelined and num_stages > 1:
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
