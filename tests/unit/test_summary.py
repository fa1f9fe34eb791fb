"""The end of a run's summary: errors by type, the most frequent first, and where they are."""

from __future__ import annotations

from batchrun.io.manifest import Counts
from batchrun.job.summary import RunSummary


def test_errors_line_counts_by_type_and_names_the_files() -> None:
    s = RunSummary()
    assert s.errors_line("runs/x") is None and not s.all_failed
    for kind in ["invalid_json"] * 12 + ["context_length_exceeded"] * 3 + ["engine_error"] * 3:
        s.add_error(kind)
    s.error_files = ["errors-00000.jsonl"]
    assert s.errors_line("runs/x") == (
        "errors: 12 invalid_json, 3 context_length_exceeded, 3 engine_error -> "
        "runs/x/errors-00000.jsonl"
    )
    assert s.all_failed and s.rows == s.rows_failed == 18
    s.error_files = ["errors-00000.jsonl", "errors-00001.jsonl"]
    assert s.errors_line("runs/x").endswith("-> runs/x/errors-*.jsonl (2 files)")


def test_error_types_survive_a_resume() -> None:
    s = RunSummary.from_counts(Counts(rows_total=3, rows_failed=3, error_types={"a": 3}))
    s.add_error("b")
    assert s.counts().error_types == {"a": 3, "b": 1} and s.resumed_rows == 3
