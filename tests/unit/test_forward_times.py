"""engine/model_runner.py's GPU forward time: a step of prefill chunks alone has no host copy
for wait() to block on, so its forward may still run when wait() returns; its CUDA events are
counted once they complete, in order, never read before (torch raises on an incomplete event)."""

from __future__ import annotations

import collections
from types import SimpleNamespace

from batchrun.engine.model_runner import ModelRunner


class FakeEvent:
    def __init__(self, t: float, done: bool = True):
        self.t, self.done = t, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: FakeEvent) -> float:  # ms, as torch.cuda.Event's
        assert self.done and end.done, "both events must be completed"
        return (end.t - self.t) * 1e3


def test_forward_times_settle_in_order_once_complete():
    runner = SimpleNamespace(forward_time=0.0, _timed=collections.deque())
    first = (FakeEvent(0.0), FakeEvent(1.0, done=False))  # prefill chunks alone, still running
    second = (FakeEvent(1.0), FakeEvent(1.5))
    runner._timed.append(first)
    ModelRunner._settle_forward_times(runner)
    assert runner.forward_time == 0.0 and len(runner._timed) == 1
    runner._timed.append(second)
    ModelRunner._settle_forward_times(runner)  # the oldest first: the second waits behind it
    assert runner.forward_time == 0.0 and len(runner._timed) == 2
    first[1].done = True
    ModelRunner._settle_forward_times(runner)
    assert runner.forward_time == 1.5 and not runner._timed
