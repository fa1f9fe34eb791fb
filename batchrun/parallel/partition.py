"""What one tensor-parallel rank holds of a model, and where its slices sit in the full tensors.

Heads split evenly: rank r holds q heads [r*H/tp, (r+1)*H/tp). KV heads split the same way when
num_kv_heads % tp == 0; with fewer KV heads than ranks each rank keeps the one KV head its q
heads attend with (replicated across tp / num_kv_heads ranks):

    H=8, KV=2, tp=4:  rank     0     1     2     3
                      q heads  0,1   2,3   4,5   6,7
                      kv head  0     0     1     1

A sharded parameter is described by a ShardSpec: along one dim, runs of the full (TP=1) tensor
copied to offsets of the local one. Fused projections have several runs:

    qkv_proj rows, full:   [ q: H*D          | k: KV*D        | v: KV*D        ]
    local (rank r):        [ q heads of r    | kv heads of r  | kv heads of r  ]

The vocabulary splits into ceil(V / tp) rows per rank; the last rank's tail is zero padding.

A mixture of experts splits every expert along its width I, as the dense MLP splits: rank r holds
columns [r*I/tp, (r+1)*I/tp) of each expert's gate and up (rows of w13 [E, 2I, H], in two runs)
and the same rows of down (columns of w2 [E, H, I]); the router is replicated, and one
all-reduce sums the experts' (and a shared expert's) partial outputs.

A hybrid's linear-attention layers split by key head (and the value heads grouped with each):
linear_num_key_heads must divide by tp (models/blocks/gated_deltanet.py holds the layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from batchrun.errors import ModelConfigError

if TYPE_CHECKING:
    from batchrun.models.config import ModelConfig


class Run(NamedTuple):
    full_start: int  # index along the spec's dim in the full tensor
    local_start: int  # ... and in the local one
    length: int


class ShardSpec(NamedTuple):
    dim: int  # the dimension that is split
    full_size: int  # its size in the full tensor
    runs: tuple[Run, ...]

    @property
    def local_len(self) -> int:
        """Rows (along dim) that hold real data; the local tensor may be longer (padding)."""
        return sum(r.length for r in self.runs)

    def pieces(self, seg_start: int, seg_len: int) -> list[tuple[int, int, int]]:
        """The parts of full [seg_start, seg_start + seg_len) this rank holds, as (offset in the
        segment, offset in the local tensor, length): how a checkpoint tensor that fills one
        segment of a fused parameter (say k_proj inside qkv_proj) lands here."""
        out = []
        for run in self.runs:
            lo = max(run.full_start, seg_start)
            hi = min(run.full_start + run.length, seg_start + seg_len)
            if lo < hi:
                out.append((lo - seg_start, run.local_start + lo - run.full_start, hi - lo))
        return out


def replicated(size: int) -> ShardSpec:
    return ShardSpec(0, size, (Run(0, 0, size),))


@dataclass(frozen=True)
class TPPartition:
    rank: int
    size: int
    num_heads: int  # local q heads
    num_kv_heads: int  # local kv heads
    head_start: int  # first local q head
    kv_head_start: int  # first local kv head
    head_dim: int
    intermediate_size: int  # local
    vocab_size: int  # full
    vocab_per_rank: int  # local rows of embed_tokens / lm_head, padding included
    moe_intermediate_size: int = 0  # local width of each expert
    shared_intermediate_size: int = 0  # local width of a shared expert

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def qkv_spec(self, cfg: ModelConfig) -> ShardSpec:
        d, q_full, kv_full = self.head_dim, cfg.q_size, cfg.kv_size
        q_len, kv_len = self.q_size, self.kv_size
        kv0 = self.kv_head_start * d
        return ShardSpec(
            0,
            q_full + 2 * kv_full,
            (
                Run(self.head_start * d, 0, q_len),
                Run(q_full + kv0, q_len, kv_len),
                Run(q_full + kv_full + kv0, q_len + kv_len, kv_len),
            ),
        )

    def o_spec(self, cfg: ModelConfig) -> ShardSpec:  # o_proj input columns
        return ShardSpec(1, cfg.q_size, (Run(self.head_start * self.head_dim, 0, self.q_size),))

    def gate_up_spec(self, cfg: ModelConfig, width: int | None = None, dim: int = 0) -> ShardSpec:
        """gate_up rows [gate | up] of an MLP of full `width` (the dense one's by default);
        `dim` 1: the rows of each expert in a stacked [E, 2I, H] weight."""
        inter = cfg.intermediate_size if width is None else width
        local = inter // self.size
        start = self.rank * local
        return ShardSpec(dim, 2 * inter, (Run(start, 0, local), Run(inter + start, local, local)))

    def down_spec(self, cfg: ModelConfig, width: int | None = None, dim: int = 1) -> ShardSpec:
        """down_proj input columns of an MLP of full `width`; `dim` 2 for stacked [E, H, I]."""
        inter = cfg.intermediate_size if width is None else width
        local = inter // self.size
        return ShardSpec(dim, inter, (Run(self.rank * local, 0, local),))

    def vocab_spec(self) -> ShardSpec:
        length = max(0, min(self.vocab_per_rank, self.vocab_size - self.vocab_start))
        runs = (Run(self.vocab_start, 0, length),) if length else ()
        return ShardSpec(0, self.vocab_size, runs)


def partition_model(cfg: ModelConfig, rank: int = 0, size: int = 1) -> TPPartition:
    """Rank `rank`'s share of `cfg` under tensor parallelism of `size`; raises ModelConfigError
    when the model does not split that way."""
    if not 0 <= rank < size:
        raise ValueError(f"tp rank {rank} is outside tp size {size}")
    heads, kv_heads, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if heads % size:
        raise ModelConfigError(
            f"--tp {size}: the model's {heads} attention heads do not split evenly over {size} "
            f"ranks; use a tensor-parallel size that divides {heads}"
        )
    lin = cfg.linear_attention
    if lin is not None and lin.num_k_heads % size:
        raise ModelConfigError(
            f"--tp {size}: the linear-attention layers' {lin.num_k_heads} key heads "
            f"(linear_num_key_heads) do not split evenly over {size} ranks; use a "
            f"tensor-parallel size that divides {lin.num_k_heads}"
        )
    if kv_heads >= size and kv_heads % size:
        raise ModelConfigError(
            f"--tp {size}: the model's {kv_heads} KV heads do not split evenly over {size} "
            f"ranks; use a tensor-parallel size that divides {kv_heads}"
        )
    if kv_heads < size and size % kv_heads:
        raise ModelConfigError(
            f"--tp {size}: with fewer KV heads ({kv_heads}) than ranks, each KV head is "
            f"replicated, which needs tp to be a multiple of {kv_heads}"
        )
    moe = cfg.moe
    dense_layers = moe is None or len(moe.layers) < cfg.num_layers
    if dense_layers and inter % size:
        raise ModelConfigError(
            f"--tp {size}: the MLP width {inter} does not split evenly over {size} ranks"
        )
    widths = {}
    if moe is not None:
        widths = {f"expert width ({moe.width_field})": moe.intermediate_size}
        if moe.shared_expert_intermediate_size:
            widths["shared expert width (shared_expert_intermediate_size)"] = (
                moe.shared_expert_intermediate_size
            )
    for what, width in widths.items():
        if width % size:
            raise ModelConfigError(
                f"--tp {size}: the {what} {width} does not split evenly over {size} ranks; "
                f"use a tensor-parallel size that divides {width}"
            )
    local_heads = heads // size
    if kv_heads >= size:
        local_kv, kv_start = kv_heads // size, rank * (kv_heads // size)
    else:
        local_kv, kv_start = 1, rank * kv_heads // size
    return TPPartition(
        rank=rank,
        size=size,
        num_heads=local_heads,
        num_kv_heads=local_kv,
        head_start=rank * local_heads,
        kv_head_start=kv_start,
        head_dim=cfg.head_dim,
        intermediate_size=inter // size,
        vocab_size=cfg.vocab_size,
        vocab_per_rank=-(-cfg.vocab_size // size),
        moe_intermediate_size=moe.intermediate_size // size if moe else 0,
        shared_intermediate_size=moe.shared_expert_intermediate_size // size if moe else 0,
    )
