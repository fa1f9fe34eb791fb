"""Tensor-parallel state: which rank this process is, of how many, and the collectives it needs.

`TPGroup()` (size 1) is the no-op default: every collective returns its input untouched, so the
single-GPU path runs the same code and pays one integer comparison per call.

A TP>1 engine runs one process per rank; `init_distributed` joins them into the default
torch.distributed group (NCCL on CUDA, gloo on the CPU), and `tp_group_for(config)` hands that
group to the model. The TP group is the whole world: data parallelism runs separate engines,
each with a world of its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None when size == 1

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place (x must be contiguous)."""
        if self.size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise max of x over the ranks, in place (x must be contiguous)."""
        if self.size == 1:
            return x
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., N] on each rank -> [..., size * N], rank r's part at [r*N, (r+1)*N)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if x.is_cuda:
            # NOTE: one NCCL call into one buffer (dim 0), then move the rank axis last
            out = torch.empty(
                (self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device
            )
            dist.all_gather_into_tensor(out, x, group=self.group)
            parts = out.view(self.size, *x.shape).unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


def disable_nvls() -> None:
    """NCCL's NVLink multicast (NVLS) stays off in every process batchrun starts: it costs
    extra device memory per communicator, and plain ring/tree all-reduce is enough for the
    small activations tensor parallelism moves. Set before any communicator exists."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"


def init_distributed(
    backend: str,
    init_method: str,
    rank: int,
    world_size: int,
    timeout_s: float = 600.0,
    device_index: int | None = None,
) -> TPGroup:
    """Join the default process group (`init_method`: tcp://host:port or file:///path) and
    return it as a TPGroup. `timeout_s` bounds every collective, so a dead peer fails a step
    instead of hanging it. With NCCL, `device_index` (already set as current) starts the
    communicator now rather than inside the first forward, which may be a CUDA-graph capture."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl'; got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    disable_nvls()
    kwargs: dict[str, Any] = {}
    if backend == "nccl" and device_index is not None:
        kwargs["device_id"] = torch.device("cuda", device_index)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )
    return TPGroup(rank, world_size, dist.group.WORLD)


def tp_group_for(config) -> TPGroup:
    """The TPGroup an EngineConfig asks for: the no-op group for tp_size 1, else the default
    process group, which must already match (tp_rank, tp_size)."""
    size, rank = getattr(config, "tp_size", 1), getattr(config, "tp_rank", 0)
    if size == 1:
        return TPGroup()
    if not dist.is_initialized():
        raise RuntimeError(
            f"tp_size={size} needs torch.distributed to be initialized in every rank's process; "
            "start the engine with batchrun.engine_process.tp_launcher.start_tp_engine"
        )
    if dist.get_world_size() != size or dist.get_rank() != rank:
        raise RuntimeError(
            f"EngineConfig says rank {rank} of {size}, but this process is rank "
            f"{dist.get_rank()} of a world of {dist.get_world_size()}"
        )
    return TPGroup(rank, size, dist.group.WORLD)
