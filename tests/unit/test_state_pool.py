"""The hybrid models' state pool (engine/state_pool.py): its size, the rows it clears, and the
memory rule's refusal of states that leave no room for the KV cache."""

from __future__ import annotations

import pytest
import torch

from batchrun.attention.base import AttentionInputs
from batchrun.engine.state_pool import StatePool, state_budget
from batchrun.errors import ModelConfigError
from batchrun.models.hybrid_config import LinearAttentionConfig

LIN = LinearAttentionConfig(layers=(0, 2), num_k_heads=2, num_v_heads=4, head_k_dim=16,
                            head_v_dim=8, conv_kernel=4, fused_projections=False)  # fmt: skip


def inputs(rows, seq, ext) -> AttentionInputs:
    t = torch.tensor
    return AttentionInputs(t(rows), t(seq), t(ext), t([0] * sum(ext)), tuple(seq), tuple(ext))


def test_bytes_per_row():
    conv = (2 * 2 * 16 + 4 * 8) * 3
    ssm = 4 * 16 * 8
    assert StatePool(LIN).bytes_per_row() == 2 * (conv + ssm) * 4


def test_prepare_clears_the_rows_that_start():
    pool = StatePool(LIN)
    pool.allocate(4, "cpu")
    pool.conv.fill_(1.0)
    pool.ssm.fill_(1.0)
    pool.prepare(inputs([1, 2], seq=[5, 7], ext=[5, 1]))  # row 1 starts, row 2 continues
    assert pool.conv[:, 1].abs().sum() == 0 and pool.ssm[:, 1].abs().sum() == 0
    assert bool((pool.conv[:, 2] == 1).all()) and bool((pool.ssm[:, 0] == 1).all())


def test_states_that_do_not_fit_are_refused_before_any_row():
    assert state_budget(10_000, 4_000, 100, 1) == 6_000
    with pytest.raises(ModelConfigError, match="recurrent states.*--max-running"):
        state_budget(10_000, 9_950, 100, 1)
