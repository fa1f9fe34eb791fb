"""The recurrent state of a hybrid model's linear-attention layers, one slot a request row.

    conv [num_linear_layers, rows, conv_dim, K-1]     the conv1d's last K-1 inputs
    ssm  [num_linear_layers, rows, Hv, Dk, Dv]        the delta rule's state

A slot is the request's row of the request-to-token table (ReqToTokenPool): it is allocated at
admission and freed at finish or retraction with that row, and the dummy row (the last) serves
scoring and padded batches. A request whose step starts at position 0 starts from a zero state
(`prepare` clears it); a later chunk or decode step continues from the slot, which a prefix
cache hit fills from a state snapshot first (engine/state_snapshots.py).

The states' element type is EngineConfig.linear_state_dtype (docs/hybrid.md: the memory rule
that counts them beside the KV pool, and the measurement behind the default); the math reads them
into fp32 and writes them back.

A CUDA-graph decode step (engine/cuda_graph.py) points `rows` at the graph's static buffer
(`prepare_graph`): the kernels read and write the slots in place, so a replay sees the live state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchrun.attention.base import AttentionInputs
from batchrun.errors import ModelConfigError
from batchrun.models.hybrid_config import LinearAttentionConfig


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
        self.cu_seqlens: torch.Tensor | None = None  # [B+1] int64 on the device
        self.max_len = 0  # the longest request's new tokens in the step
        # tensors derived from the step's rows and lengths, built by the first layer that needs
        # them and read by the others (models/blocks/delta_rule_fla.py); emptied each step
        self.step_cache: dict[str, torch.Tensor] = {}

    @property
    def is_decode(self) -> bool:
        """Whether the step is one token a request."""
        return self.max_len == 1

    def bytes_per_row(self, dtype: str = "float32") -> int:
        return self.lin.state_bytes(self.tp_size, dtype)

    def allocate(self, num_rows: int, device: torch.device | str, dtype: str = "float32") -> None:
        lin, tp = self.lin, self.tp_size
        n, element = len(lin.layers), getattr(torch, dtype)
        self.conv = torch.zeros(
            (n, num_rows, lin.conv_dim // tp, lin.conv_kernel - 1), dtype=element, device=device
        )
        self.ssm = torch.zeros(
            (n, num_rows, lin.num_v_heads // tp, lin.head_k_dim, lin.head_v_dim),
            dtype=element, device=device,
        )  # fmt: skip

    def prepare(self, inputs: AttentionInputs) -> None:
        """The step's rows and their lengths; the rows that start at position 0 get a zero
        state."""
        assert self.conv is not None, "allocate the state pool first"
        self.rows = inputs.req_pool_indices
        self.extend_lens_cpu = inputs.extend_lens_cpu
        self.max_len = max(inputs.extend_lens_cpu, default=0)
        self.cu_seqlens = F.pad(inputs.extend_lens.cumsum(0), (1, 0))
        self.step_cache = {}
        self.clear_fresh(inputs)

    def prepare_graph(self, rows: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
        """A decode graph's step: `rows` [bs] and `cu_seqlens` [bs+1] (0, 1, .., bs) are the
        graph's static buffers, filled before each replay."""
        self.rows, self.cu_seqlens = rows, cu_seqlens
        self.extend_lens_cpu = (1,) * rows.shape[0]
        self.max_len = 1
        self.step_cache = {}

    def clear_fresh(self, inputs: AttentionInputs) -> None:
        """Zero the states of the rows whose step starts at position 0."""
        fresh = [
            b for b, (s, e) in enumerate(zip(inputs.seq_lens_cpu, inputs.extend_lens_cpu)) if s == e
        ]
        if fresh:
            rows = inputs.req_pool_indices
            rows = rows[fresh] if len(fresh) < len(rows) else rows
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
