"""scripts/step_trace.py: each step's forward and the device's gap before it, from the wrapper
around the runner's internal _run_forward."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import benchlib  # noqa: E402
from step_trace import StepTrace, size_bucket, step_kind  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402


class FakeEvent:
    """A CUDA event recorded at t ms on the device."""

    def __init__(self, t: float):
        self.t = t

    def elapsed_time(self, other: FakeEvent) -> float:
        return other.t - self.t


def trace_of(steps) -> StepTrace:
    trace = StepTrace.__new__(StepTrace)  # no engine: the steps are given
    trace.steps = [
        (kind, tokens, reqs, host, FakeEvent(start), FakeEvent(end))
        for kind, tokens, reqs, host, start, end in steps
    ]
    trace.run_start = trace.run_end = trace.first_step = None
    trace.collections = []
    return trace


def test_rows_give_forwards_gaps_and_host_time():
    trace = trace_of(
        [
            ("piecewise", 4352, 256, 0.000, 0.0, 17.0),
            ("decode-graph", 256, 256, 0.004, 17.2, 20.0),
            ("decode-graph", 256, 256, 0.007, 20.3, 23.0),
        ]
    )
    rows = trace.rows()
    assert rows[0]["gap_ms"] is None and rows[0]["fwd_ms"] == 17.0
    assert abs(rows[1]["gap_ms"] - 0.2) < 1e-9 and abs(rows[2]["gap_ms"] - 0.3) < 1e-9
    assert abs(rows[2]["host_ms"] - 3.0) < 1e-6
    report = trace.report()
    assert "3 steps over 23.0 ms" in report
    assert "decode-graph <=256 | 2 |" in report
    assert "host: first launch" not in report  # no run times given
    trace.run_start, trace.run_end = -0.0125, 0.010
    assert "first launch 12.5 ms after the run's start, the run's end 3.0 ms after" in (
        trace.report()
    )
    assert "gc in the run: none" in trace.report()
    trace.first_step = -0.0025
    # a gen2 collection of 8 ms before the first launch, a gen0 of 1 ms after, one outside
    trace.collections = [(2, -0.011, -0.003), (0, 0.002, 0.003), (2, 0.5, 0.6)]
    report = trace.report()
    assert "first engine.step() 10.0 ms after the run's start" in report
    assert "gen0 1 x, 1.0 ms (max 1.0; 0.0 before the first launch)" in report
    assert "gen2 1 x, 8.0 ms (max 8.0; 8.0 before the first launch)" in report


def test_size_bucket_is_the_next_power_of_two():
    assert [size_bucket(n) for n in (1, 3, 256, 257)] == ["<=1", "<=4", "<=256", "<=512"]


def test_trace_wraps_the_runner_and_comes_off_on_close(tmp_path):
    """On the CPU the forwards have no CUDA events: the trace sees every forward (an eager one)
    and records none; close() leaves the runner and the engine as they were."""
    model_dir = benchlib.write_model_dir("tiny", tmp_path)
    engine = Engine(EngineConfig(model=str(model_dir), load_format="dummy", device="cpu"))
    runner = engine.runner
    kinds = []
    inner = runner._run_forward

    def spy(staged):
        kinds.append(step_kind(runner, staged))
        return inner(staged)

    runner._run_forward = spy
    trace = StepTrace(engine)
    prompts = benchlib.make_workload("W1", 0.001).prompts
    benchlib.run_engine_once(engine, prompts, 3, benchlib.Device("cpu"), None)
    assert kinds == ["eager"] * 3 and trace.first_step is None  # run_start not set
    assert trace.report() == "step trace: no CUDA steps"
    trace.close()
    assert runner._run_forward is spy and "step" not in vars(engine)
