"""Tensor parallelism on one node (issue 9).

    state.py      TPGroup (rank, size, group; TPGroup() is the no-op TP=1), init, collectives
    partition.py  which heads / MLP columns / vocab rows a rank holds (ShardSpec per parameter)
    layers.py     column- and row-parallel linear layers, vocab-parallel embedding
    lockstep.py   LockstepEngine (rank 0) + follower_loop (ranks > 0): one Engine per rank
    launcher.py   start_tp_engine(config, tp_size, base_device_index) -> LockstepEngine

lockstep and launcher import the engine; import them by module path (not from here), since the
engine's model runner imports this package.
"""

from batchrun.parallel.partition import ShardSpec, TPPartition, partition_model
from batchrun.parallel.state import TPGroup, init_distributed, tp_group_for

__all__ = [
    "ShardSpec",
    "TPGroup",
    "TPPartition",
    "init_distributed",
    "partition_model",
    "tp_group_for",
]
