"""The recurrent state of a hybrid model's linear-attention layers, one slot a request row.

    conv [num_linear_layers, rows, conv_dim, K-1]     the conv1d's last K-1 inputs
    ssm  [num_linear_layers, rows, Hv, Dk, Dv]        the delta rule's state

A slot is the request's row of the request-to-token table (ReqToTokenPool): it is allocated at
admission and freed at finish or retraction with that row, and the dummy row (the last) serves
scoring and padded batches. A request whose step starts at position 0 starts from a zero state
(`prepare` clears it); a later chunk or decode step continues from the slot, which a prefix
cache hit fills from a state snapshot first (engine/state_snapshots.py).

The states are fp32, as transformers keeps them between steps (docs/hybrid.md: the memory rule
that counts them beside the KV pool, and why not bf16).
"""

from __future__ import annotations

import torch

from batchrun.attention.base import AttentionInputs
from batchrun.errors import ModelConfigError
from batchrun.models.hybrid_config import LinearAttentionConfig

STATE_DTYPE = torch.float32  # hybrid_config.STATE_ELEMENT_BYTES a element


class StatePool:
    def __init__(self, lin: LinearAttentionConfig, tp_size: int = 1):
        """Unallocated until `allocate`: the model is built (and holds the pool) before the
        memory budget is known."""
        self.lin = lin
        self.tp_size = tp_size
        self.conv: torch.Tensor | None = None
        self.ssm: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None  # [B] int64, the step's request rows
        self.extend_lens_cpu: tuple[int, ...] = ()

    def bytes_per_row(self) -> int:
        return self.lin.state_bytes(self.tp_size)

    def allocate(self, num_rows: int, device: torch.device | str) -> None:
        lin, tp = self.lin, self.tp_size
        n = len(lin.layers)
        self.conv = torch.zeros(
            (n, num_rows, lin.conv_dim // tp, lin.conv_kernel - 1), dtype=STATE_DTYPE, device=device
        )
        self.ssm = torch.zeros(
            (n, num_rows, lin.num_v_heads // tp, lin.head_k_dim, lin.head_v_dim),
            dtype=STATE_DTYPE, device=device,
        )  # fmt: skip

    def prepare(self, inputs: AttentionInputs) -> None:
        """The step's rows; the rows that start at position 0 get a zero state."""
        assert self.conv is not None, "allocate the state pool first"
        self.rows = inputs.req_pool_indices
        self.extend_lens_cpu = inputs.extend_lens_cpu
        fresh = [
            b for b, (s, e) in enumerate(zip(inputs.seq_lens_cpu, inputs.extend_lens_cpu)) if s == e
        ]
        if fresh:
            rows = self.rows[fresh] if len(fresh) < len(self.rows) else self.rows
            self.conv[:, rows] = 0
            self.ssm[:, rows] = 0


def state_budget(budget: int, state_bytes: int, kv_bytes_per_token: int, page: int) -> int:
    """The memory left for the KV pool once the states of every request row (`state_bytes`) are
    taken from `budget`; ModelConfigError when the states leave no room for a page of KV."""
    left = budget - state_bytes
    if left < kv_bytes_per_token * page:
        raise ModelConfigError(
            f"the recurrent states of the linear-attention layers take {state_bytes / 2**30:.2f} "
            f"GiB for --max-running rows, more than the memory budget of {budget / 2**30:.2f} "
            "GiB leaves for them and the KV cache; lower --max-running or raise "
            "--gpu-memory-utilization"
        )
    return left
