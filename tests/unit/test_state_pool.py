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


def test_the_state_dtype_sets_the_bytes_and_the_tensors():
    assert StatePool(LIN).bytes_per_row("bfloat16") * 2 == StatePool(LIN).bytes_per_row()
    pool = StatePool(LIN)
    pool.allocate(3, "cpu", "bfloat16")
    assert pool.conv.dtype == pool.ssm.dtype == torch.bfloat16
    assert pool.conv.nbytes + pool.ssm.nbytes == 3 * pool.bytes_per_row("bfloat16")


def test_prepare_keeps_the_step_lengths_on_the_device():
    pool = StatePool(LIN)
    pool.allocate(4, "cpu")
    pool.step_cache["x"] = torch.zeros(1)
    pool.prepare(inputs([1, 2, 0], seq=[5, 7, 3], ext=[5, 1, 2]))
    assert pool.cu_seqlens.tolist() == [0, 5, 6, 8] and pool.max_len == 5
    assert not pool.is_decode and pool.step_cache == {}
    pool.prepare(inputs([1, 2], seq=[6, 8], ext=[1, 1]))
    assert pool.is_decode


def test_a_graph_step_reads_the_static_rows():
    pool = StatePool(LIN)
    pool.allocate(4, "cpu")
    rows, cu = torch.tensor([3, 3]), torch.arange(3)
    pool.prepare_graph(rows, cu)
    assert pool.rows is rows and pool.cu_seqlens is cu and pool.is_decode
    assert pool.extend_lens_cpu == (1, 1)
    pool.conv.fill_(1.0)
    pool.ssm.fill_(1.0)
    pool.clear_fresh(inputs([2, 0], seq=[1, 4], ext=[1, 1]))  # row 2's first token is a decode
    assert pool.ssm[:, 2].abs().sum() == 0 and bool((pool.ssm[:, 0] == 1).all())
    assert pool.rows is rows  # clearing leaves the graph's rows
