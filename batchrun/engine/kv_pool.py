"""Device memory for KV: a token-indexed pool per layer and the request-to-token table.

KVPool           k/v buffers [num_slots + 1, num_kv_heads, head_dim] per layer that writes KV
                 (`shapes`: each its own heads and dims; ModelConfig.kv_layers); the extra last
                 slot is a dummy that padded (graph) batches may write into harmlessly. Under
                 tensor parallelism num_kv_heads is this rank's (model.num_kv_heads), not the
                 model's: each rank stores only the KV heads its q heads attend with.
                 `store_rotated` also applies rotary to q and k, in one kernel with the Triton
                 kernels on (kernels/rotary_kv_store.py; else rotary, then `store`).
                 In float8_e4m3fn (--kv-cache-dtype fp8_e4m3) every store quantizes with the
                 layer's scales (`scales(layer_id)`, batchrun/quant/kv_cache.py) and every
                 reader folds them into its softmax scale and output.
ReqToTokenPool   [max_reqs + 1, max_context] int32: row r, position p -> KV slot of that token.
                 Rows are handed out to running requests; the last row is the dummy request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from batchrun.config import KernelPlan
from batchrun.quant.kv_cache import KV_FP8_DTYPE, KVScale, quantize_kv

try:
    from batchrun.kernels.kv_store import store_kv
    from batchrun.kernels.rotary_kv_store import rotary_store_kv
except ImportError:  # no Triton (CPU-only installs): KernelPlan.triton_ops is off
    store_kv = rotary_store_kv = None

if TYPE_CHECKING:
    from batchrun.layers.rotary import RotaryEmbedding


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,  # the stored element type: the compute dtype or float8_e4m3fn
        device: torch.device | str,
        kernels: KernelPlan | None = None,
        scales: list[KVScale] | None = None,  # float8 only: per layer; None: all 1.0
        shapes: tuple[tuple[int, int], ...] | None = None,  # per layer (KV heads, head dim)
    ):
        self.kernels = kernels or KernelPlan.reference()
        self.num_slots = num_slots
        self.dummy_slot = num_slots
        self.is_fp8 = dtype == KV_FP8_DTYPE
        assert scales is None or (self.is_fp8 and len(scales) == num_layers)
        self._scales = scales or [KVScale()] * num_layers
        shapes = shapes or ((num_kv_heads, head_dim),) * num_layers
        assert len(shapes) == num_layers
        sizes = [(num_slots + 1, heads, dim) for heads, dim in shapes]
        self.k_buffers = [torch.zeros(size, dtype=dtype, device=device) for size in sizes]
        self.v_buffers = [torch.zeros(size, dtype=dtype, device=device) for size in sizes]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    @staticmethod
    def bytes_per_token_of(shapes: tuple[tuple[int, int], ...], dtype) -> int:
        """K and V bytes of one token over layers of (KV heads, head dim) `shapes`."""
        elements = sum(heads * dim for heads, dim in shapes)
        return 2 * elements * torch.empty(0, dtype=dtype).element_size()

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # loc: [T], k/v: [T, KV, D] (possibly strided views of the fused qkv projection)
        k_buf, v_buf = self.k_buffers[layer_id], self.v_buffers[layer_id]
        scale = self._scales[layer_id]
        if self._stores_in_triton(layer_id, loc, k, v):
            # NOTE: one launch writes both k and v (torch needs an index_put for each)
            store_kv(k_buf, v_buf, loc, k, v, pdl=self.kernels.pdl, **self._inv_scales(scale))
            return
        if self.is_fp8:
            k_buf[loc] = quantize_kv(k, scale.inv_k)
            v_buf[loc] = quantize_kv(v, scale.inv_v)
            return
        k_buf[loc] = k.to(k_buf.dtype)
        v_buf[loc] = v.to(v_buf.dtype)

    def store_rotated(
        self,
        layer_id: int,
        loc: torch.Tensor,  # [T]
        q: torch.Tensor,  # [T, H, D], before rotary
        k: torch.Tensor,  # [T, KV, D], before rotary
        v: torch.Tensor,  # [T, KV, D]
        positions: torch.Tensor,  # [T]
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        """`q, k = rotary(positions, q, k)`, then `store(layer_id, loc, k, v)`; returns the rotated
        q. On the Triton path one kernel does both and rotates q in place. NOTE: there k is left
        unrotated (only its copy in the pool is rotated): a caller must read keys from the pool."""
        if self.fuses_rotary(layer_id, loc, q, k, v, positions, rotary):
            k_buf, v_buf = self.buffers(layer_id)
            cos, sin = rotary.cos_cache, rotary.sin_cache
            rotary_store_kv(
                k_buf, v_buf, loc, q, k, v, positions, cos, sin, pdl=self.kernels.pdl,
                **self._inv_scales(self._scales[layer_id]),
            )  # fmt: skip
            return q
        q, k = rotary(positions, q, k)
        self.store(layer_id, loc, k, v)
        return q

    def _stores_in_triton(self, layer_id: int, loc, k, v) -> bool:
        """Whether `store` runs kernels/kv_store.py (else torch's index_put)."""
        return (
            self.kernels.triton_ops
            and k.dtype == v.dtype
            and (self.is_fp8 or k.dtype == self.k_buffers[layer_id].dtype)
            and k.stride(-1) == v.stride(-1) == 1
            and loc.device == k.device
        )

    def fuses_rotary(self, layer_id, loc, q, k, v, positions, rotary) -> bool:
        """Whether rotary and store would both run their Triton kernels (the one kernel then
        gives the same bits)."""
        return (
            self._stores_in_triton(layer_id, loc, k, v)
            and rotary.kernels.triton_ops
            and q.dtype == k.dtype
            and q.stride(-1) == 1
            and positions.device == q.device
            # NOTE: a partial-rotary model's table (Phi-3 / Phi-4) is narrower than the head:
            # the fused kernels rotate whole heads, so it rotates in place, then stores
            and rotary.cos_cache.shape[-1] == q.shape[-1]
        )

    def buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def scales(self, layer_id: int) -> KVScale:
        """The layer's KV scales (1.0 and 1.0 for a pool in the compute dtype)."""
        return self._scales[layer_id]

    def _inv_scales(self, scale: KVScale) -> dict:
        """The store kernels' quantization arguments (none for a pool in the compute dtype)."""
        if not self.is_fp8:
            return {}
        return {"k_inv_scale": scale.inv_k, "v_inv_scale": scale.inv_v}


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
