"""The sliding layers' window pool (engine/window_pool.py): slots behind the window go back to the
pool a stride at a time, their table entries point at the dummy slot, the pool's integrity holds,
the rule that turns it on, and the KV budget's split."""

from __future__ import annotations

import pytest
import torch

from batchrun.engine import window_pool
from batchrun.engine.window_pool import (
    FREE_STRIDE,
    WindowSlots,
    split_kv_budget,
    split_shapes,
    window_slots,
)

W = 8


def slots(num_slots: int = 200, stride: int = 4, monkeypatch=None) -> WindowSlots:
    if monkeypatch is not None:
        monkeypatch.setattr(window_pool, "FREE_STRIDE", stride)
    return WindowSlots(num_slots, W, max_reqs=3, max_context=128, device="cpu", prefill=16)


def test_prefill_then_decodes_keep_the_window(monkeypatch):
    ws = slots(stride=4, monkeypatch=monkeypatch)
    assert ws.reserve(0, 0, 30)  # a 30-token prompt in one chunk
    assert ws.num_held == 30
    kv_len = 30
    for _ in range(20):
        assert ws.reserve_decodes([0], [kv_len])
        # the step's query at kv_len reads positions > kv_len - W: all held
        first = kv_len - W + 1
        assert ws.start[0] <= first and ws.end[0] == kv_len + 1
        assert kv_len + 1 - ws.start[0] <= W + 4  # at most a stride behind the window
        assert (ws.table_cpu[0, : ws.start[0]] == ws.dummy_slot).all()
        assert (ws.table_cpu[0, ws.start[0] : ws.end[0]] < ws.dummy_slot).all()
        ws.check_integrity()
        kv_len += 1
    # the device table mirrors the host one (CPU: writes land at once)
    assert torch.equal(ws.req_pool.table[0].long(), ws.table_cpu[0])
    ws.release(0)
    assert ws.allocator.num_free == ws.capacity
    ws.check_integrity()


def test_chunks_across_the_window_and_retries(monkeypatch):
    ws = slots(stride=1, monkeypatch=monkeypatch)
    kv_len = 0
    for n in (5, 5, 5, 5):
        assert ws.reserve(1, kv_len, n)
        assert ws.reserve(1, kv_len, n)  # a retry holds what it has
        assert ws.start[1] == max(0, kv_len - W + 1)
        kv_len += n
    held = ws.num_held
    assert held == kv_len - max(0, 15 - W + 1)
    ws.check_integrity()


def test_a_short_pool_says_so_and_keeps_its_books(monkeypatch):
    ws = slots(num_slots=11, stride=1, monkeypatch=monkeypatch)
    assert ws.reserve(0, 0, 10)
    assert not ws.reserve(2, 0, 5)  # 1 free
    assert not ws.reserve_decodes([1, 2], [0, 0])  # 2 new slots, 1 free
    ws.check_integrity()
    assert ws.reserve_decodes([0], [10])  # frees positions 0 .. 2 first
    assert ws.allocator.num_free == 3
    ws.check_integrity()
    ws.release(0)
    ws.release(2)
    ws.release(1)
    assert ws.allocator.num_free == 11
    ws.check_integrity()


def test_locs_are_the_new_tokens_slots():
    ws = slots()
    assert ws.reserve(0, 0, 6) and ws.reserve(1, 0, 3)
    locs = ws.locs([0, 1], [2, 0], [4, 3])
    assert torch.equal(locs, torch.cat([ws.table_cpu[0, 2:6], ws.table_cpu[1, 0:3]]))


def test_shapes_and_budget_split():
    shapes = ((2, 16), (2, 16), (1, 32))
    full, win = split_shapes(shapes, (0, 1))
    assert full == ((0, 16), (0, 16), (1, 32)) and win == ((2, 16), (2, 16), (0, 32))
    n = window_slots(4, 100, 50)
    assert n == 4 * (100 + FREE_STRIDE) + 50
    assert split_kv_budget(10_000, 10, 5, 100, 1) == (10_000 - 500) // 10
    assert split_kv_budget(10_000, 10, 5, 100, 16) % 16 == 0
    with pytest.raises(ValueError, match="lower max_running"):
        split_kv_budget(1000, 10, 5, 500, 1)


@pytest.mark.parametrize("kv_shared", [0, 10])
def test_capacity_of_the_default_shapes(tmp_path, kv_shared):
    """transformers' Gemma4TextConfig defaults (30 layers, every 6th full at head dim 512, the
    sliding ones at 256 over 512 tokens), as is and as the E-shape (the last 10 layers
    KV-shared): in 16k-token requests, the pool holds at least 3x what it holds with every layer
    full at its own head dim and no KV shared (the benchmarks' twin), at CUDA's default sizes
    (512 running, chunks of 4096) and a 60 GB budget in bf16."""
    import json

    from transformers import Gemma4TextConfig

    from batchrun.models.config import ModelConfig

    raw = Gemma4TextConfig(num_kv_shared_layers=kv_shared).to_dict()
    raw.update(architectures=["Gemma4ForCausalLM"], model_type="gemma4_text")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = ModelConfig.from_dir(str(tmp_path))
    sliding = window_pool.sliding_kv_indices(cfg)
    assert window_pool.uses_window_pool(cfg, has_states=False)
    assert not window_pool.uses_window_pool(cfg, has_states=True)
    shapes = tuple((cfg.kv_heads_of(i), cfg.head_dim_of(i)) for i in cfg.kv_layers)
    full, win = split_shapes(shapes, sliding)
    bf16 = 2 * 2  # K and V, two bytes each

    def per_token(s):
        return bf16 * sum(h * d for h, d in s)

    twin = bf16 * sum(cfg.kv_heads_of(i) * cfg.head_dim_of(i) for i in range(cfg.num_layers))
    budget = 60 * 10**9
    window = window_pool.max_window(cfg)
    assert window == 512
    held = window_pool.requests_held(budget, per_token(full), per_token(win), window, 512, 4096)
    baseline = window_pool.requests_held(budget, twin, 0, window, 512, 4096)
    assert held >= 3 * baseline, (held, baseline)
    # every layer keeps every position (the pool as it is with the radix cache on)
    kept = window_pool.requests_held(budget, per_token(shapes), 0, window, 512, 4096)
    assert held > 2 * kept
    if kv_shared == 0:  # plan's line for --no-radix-cache
        from batchrun.job.kv_bytes import KVElement, window_bytes_line

        line = window_bytes_line(cfg, KVElement(2, "bfloat16"), 16384, 4 * 16384, 4)
        full_bytes = per_token(full)
        window_bytes = per_token(win) * (window + FREE_STRIDE)
        assert "512-token window" in line and f"{full_bytes:,} bytes a token" in line
        assert f"{(16384 * full_bytes + window_bytes) / 1e9:.2f} GB for the longest" in line
