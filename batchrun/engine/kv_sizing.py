"""How many tokens the KV pools hold: the full pool's slots and the window pool's
(engine/window_pool.py), from --kv-budget or from the device's free memory, less what a hybrid's
recurrent state rows and their prefix-cache snapshots take (engine/state_pool.py)."""

from __future__ import annotations

import psutil
import torch

from batchrun.config import EngineConfig
from batchrun.engine.kv_pool import KVPool
from batchrun.engine.state_pool import state_budget
from batchrun.engine.window_pool import (
    max_window,
    size_window_pool,
    split_kv_budget,
    window_slots,
)
from batchrun.models.config import ModelConfig
from batchrun.quant.kv_cache import kv_storage_dtype


def kv_slots(
    cfg: EngineConfig,
    model_cfg: ModelConfig,
    shapes: tuple[tuple[int, int], ...],
    window_shapes: tuple[tuple[int, int], ...],
    *,
    device: torch.device,
    dtype: torch.dtype,
    prefill_budget: int,
    state_bytes: int = 0,
) -> tuple[int, int]:
    """(the full pool's slots, the window pool's): `shapes` the full pool's layers (KV heads,
    head dim), `window_shapes` the window pool's (empty: no window pool). With the window pool
    on, kv_budget counts the full pool's tokens (the window pool holds max_running windows); a
    budget from free memory is split by size_window_pool. `state_bytes`: a hybrid's state rows
    and snapshots, taken from a budget read from memory first."""
    page = cfg.page_size
    window = max_window(model_cfg) if window_shapes else 0
    prefill = prefill_budget if window_shapes else 0
    if cfg.kv_budget is not None:
        num_window = window_slots(cfg.max_running, window, prefill) if window_shapes else 0
        return max(page, cfg.kv_budget // page * page), num_window
    kv_dtype = kv_storage_dtype(cfg.kv_cache_dtype, dtype)  # float8: one byte an element
    per_token = KVPool.bytes_per_token_of(shapes, kv_dtype)
    window_per_token = KVPool.bytes_per_token_of(window_shapes, kv_dtype)
    window_bytes = 0
    if window_shapes:
        window_bytes = window_slots(cfg.max_running, window, prefill) * window_per_token
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * cfg.gpu_memory_utilization)
    else:
        # NOTE: a CPU run is a demo or a test: an eighth of available memory, at most 32k
        # tokens (the pool is zeroed up front, so a huge one costs seconds at start-up)
        budget = min(psutil.virtual_memory().available // 8, (per_token << 15) + window_bytes)
    if state_bytes:
        budget = state_budget(budget, state_bytes, per_token, page)
    if window_shapes:
        num_window = size_window_pool(cfg.max_running, window, prefill, budget, window_per_token)
        return split_kv_budget(budget, per_token, window_per_token, num_window, page), num_window
    slots = max(budget // per_token, page)
    return slots // page * page, 0
