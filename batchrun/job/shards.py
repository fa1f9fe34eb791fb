"""Splitting one run into shards (Slurm array tasks, or any N independent processes).

Every shard streams the whole input and keeps its own rows: a row that tokenizes goes to
``order.shard_of(input_ids)`` (a whole prefix group, same first tokens, lands in one shard, so
each shard keeps its cache locality); a row that cannot run (bad JSON, missing field, too long)
goes to ``error_shard_of(row)``. Both are pure functions of the input, so every row belongs to
exactly one shard in every process and on every node. Shard I of N > 1 writes ``OUT/shard-I/``;
``batchrun merge OUT`` checks and combines them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

SHARD_DIR_PREFIX = "shard-"


class ShardOptionError(ValueError):
    """Bad --num-shards / --shard-index (or Slurm array variables)."""


def resolve_shards(
    num_shards: int | None, shard_index: int | None, env: Mapping[str, str] = os.environ
) -> tuple[int, int]:
    """(N, I) from the options, else from a Slurm array task's environment, else (1, 0).

    SLURM_ARRAY_TASK_COUNT is N; the index is (SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN) /
    SLURM_ARRAY_TASK_STEP, so ``--array=1-4`` and ``--array=0-6:2`` both give 0..N-1.
    """

    def env_int(name: str, default: int | None = None) -> int | None:
        value = env.get(name)
        if value is None or value == "":
            return default
        try:
            return int(value)
        except ValueError:
            raise ShardOptionError(f"{name}={value!r} is not an integer") from None

    if num_shards is None:
        num_shards = env_int("SLURM_ARRAY_TASK_COUNT")
    if shard_index is None:
        task_id = env_int("SLURM_ARRAY_TASK_ID")
        if task_id is not None:
            step = env_int("SLURM_ARRAY_TASK_STEP", 1) or 1
            shard_index = (task_id - (env_int("SLURM_ARRAY_TASK_MIN", 0) or 0)) // step
    if num_shards is None:
        if shard_index not in (None, 0):
            raise ShardOptionError("--shard-index needs --num-shards")
        num_shards = 1
    shard_index = 0 if shard_index is None else shard_index
    if num_shards < 1:
        raise ShardOptionError(f"--num-shards must be >= 1; got {num_shards}")
    if not 0 <= shard_index < num_shards:
        raise ShardOptionError(
            f"--shard-index {shard_index} is out of range for --num-shards {num_shards} "
            f"(0..{num_shards - 1})"
        )
    return num_shards, shard_index


def shard_dir(out: str | Path, num_shards: int, shard_index: int) -> Path:
    """Where shard I writes: OUT itself for an unsharded run, else OUT/shard-I."""
    out = Path(out)
    return out if num_shards == 1 else out / f"{SHARD_DIR_PREFIX}{shard_index}"


def error_shard_of(row: int, num_shards: int) -> int:
    """The shard that records a row which cannot run (by its row number, stable everywhere)."""
    if num_shards == 1:
        return 0
    digest = hashlib.blake2b(row.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % num_shards
