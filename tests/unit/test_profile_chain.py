"""scripts/profile_decode.py's chain report: what each kernel adds to a step's chain."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from profile_decode import (  # noqa: E402
    chain_increments,
    print_chain,
    print_step_gaps,
    step_kind_rows,
)


def test_increments_count_only_what_ends_after_the_ends_before():
    # b starts early (PDL) and ends 3 after a; c ends inside b; d starts after a gap
    events = [(0, 10, "a"), (2, 13, "b"), (11, 12, "c"), (20, 21, "d")]
    assert chain_increments(events) == [0.0, 3.0, 0.0, 8.0]


def test_layers_fold_into_one_row_per_kernel(capsys):
    # a step: embed, two layers of (gemv, attention, gemv), the head; two steps
    step = ["embed", "_gemv", "_decode_stage1", "_gemv", "_gemv", "_decode_stage1", "_gemv", "head"]
    events, t = [], 0.0
    for _ in range(2):
        for name in step:
            events.append((t, t + 2.0, name))
            t += 2.0
    print_chain(events, steps=2)
    out = capsys.readouterr().out
    assert "| 1 | _decode_stage1 | 2.00 |" in out  # the layer's second kernel, 2 µs a layer
    assert "| 7 | head | 2.00 |" in out
    assert "| step | | 16.0 |" in out


def test_steps_split_at_the_ids_copy_and_count_their_idle():
    # a decode step (10 busy of a 12 span), then a mixed one with a 3 µs hole inside it
    events = [
        (0, 8, "_decode_stage1"), (8, 9, "nvjet_gemm"), (9, 10, "Memcpy DtoH (Device -> Pinned)"),
        (12, 20, "nvjet_gemm"), (20, 22, "_decode_stage1"), (22, 26, "_extend_kernel"),
        (29, 30, "nvjet_gemm"), (30, 32, "Memcpy DtoH (Device -> Pinned)"),
        (34, 40, "nvjet_gemm"), (40, 42, "Memcpy DtoH (Device -> Pinned)"),
    ]  # fmt: skip
    rows = step_kind_rows(events)  # the first step has no end before it: not counted
    assert rows["mixed"]["steps"] == 1 and rows["mixed"]["span"] == 22.0
    assert rows["mixed"]["busy"] == 17.0  # 22 of span less the 2 before it and the 3 hole
    assert rows["mixed"]["kinds"]["extend attention"] == 4.0
    assert rows["decode"]["steps"] == 1 and rows["decode"]["span"] == 10.0
    assert rows["decode"]["busy"] == 8.0


def test_step_gaps_name_the_event_after_them(capsys):
    events = [
        (0, 1, "Memcpy DtoH"), (2, 5, "nvjet_gemm"), (30, 31, "_extend_kernel"),
        (31, 40, "nvjet_gemm"), (40, 41, "Memcpy DtoH"),
    ]  # fmt: skip
    print_step_gaps(events, "mixed")
    out = capsys.readouterr().out
    assert "| _extend_kernel | 25.0 | 1.0 |" in out
    assert "waited longest (0.025 ms in 1 gaps)" in out
    assert "gap    25.0 µs  before _extend_kernel" in out
