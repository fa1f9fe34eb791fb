"""Tensor parallelism on one node: the state and the partition the model's layers use.

    state.py      TPGroup (rank, size, group; TPGroup() is the no-op TP=1), init, collectives
    partition.py  which heads / MLP columns / vocab rows a rank holds (ShardSpec per parameter)

The parallel layers are in batchrun/layers/linear.py; the engines in lockstep and their launcher
in batchrun/engine_process/ (lockstep.py, tp_launcher.py), which import the engine.
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
