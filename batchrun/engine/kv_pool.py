"""Device memory for KV: a token-indexed pool per layer and the request-to-token table.

KVPool           k/v buffers [num_slots + 1, num_kv_heads, head_dim] per layer; the extra last
                 slot is a dummy that padded (graph) batches may write into harmlessly. Under
                 tensor parallelism num_kv_heads is this rank's (model.num_kv_heads), not the
                 model's: each rank stores only the KV heads its q heads attend with.
ReqToTokenPool   [max_reqs + 1, max_context] int32: row r, position p -> KV slot of that token.
                 Rows are handed out to running requests; the last row is the dummy request.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.num_slots = num_slots
        self.dummy_slot = num_slots
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # loc: [T], k/v: [T, KV, D] (possibly strided views of the fused qkv projection)
        from batchrun.models.layers import use_fused_kernels  # read at call time: tests patch it

        k_buf, v_buf = self.k_buffers[layer_id], self.v_buffers[layer_id]
        if (
            use_fused_kernels(k)
            and k.dtype == v.dtype == k_buf.dtype
            and k.stride(-1) == 1
            and v.stride(-1) == 1
            and loc.device == k.device
        ):
            from batchrun.kernels.kv_store import store_kv

            # NOTE: one launch writes both k and v (torch needs an index_put for each)
            store_kv(k_buf, v_buf, loc, k, v)
            return
        k_buf[loc] = k.to(k_buf.dtype)
        v_buf[loc] = v.to(v_buf.dtype)

    def buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]


class ReqToTokenPool:
    def __init__(self, max_reqs: int, max_context: int, device: torch.device | str):
        self.max_reqs = max_reqs
        self.dummy_row = max_reqs
        self.table = torch.zeros((max_reqs + 1, max_context), dtype=torch.int32, device=device)
        self._free_rows = list(range(max_reqs - 1, -1, -1))
        # NOTE: on CUDA, writes are queued and applied by the next step in one scatter (one
        # host-to-device copy per step instead of one per request)
        self._deferred = self.table.device.type == "cuda"
        self._rows: list[int] = []
        self._cols: list[int] = []
        self._slots: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def allocate(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record that positions start .. start+len(slots)-1 of `row` live in `slots`."""
        n = len(slots)
        if not n:
            return
        if not self._deferred:
            self.table[row, start : start + n] = slots.to(self.table.dtype)
            return
        self._rows.extend([row] * n)
        self._cols.extend(range(start, start + n))
        self._slots.extend(slots.tolist())

    def write_many(self, rows: list[int], cols: list[int], slots: torch.Tensor) -> None:
        """Position cols[i] of row rows[i] lives in slots[i]."""
        if not self._deferred:
            self.table[rows, cols] = slots.to(self.table.dtype)
            return
        self._rows.extend(rows)
        self._cols.extend(cols)
        self._slots.extend(slots.tolist())

    def take_pending(self) -> tuple[list[int], list[int], list[int]]:
        """Queued writes as (rows, cols, slots); the caller applies them on the device."""
        pending = (self._rows, self._cols, self._slots)
        self._rows, self._cols, self._slots = [], [], []
        return pending

    def apply(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        if rows.numel():
            self.table[rows, cols] = slots.to(self.table.dtype)
