"""gc_pause.frozen_gc: the objects alive at a run's start are frozen (out of the collector's
passes) while any run lasts, and handed back when the last one ends, abandoned runs included."""

from __future__ import annotations

import gc

from batchrun.engine.engine import drive
from batchrun.engine.gc_pause import frozen_gc


def test_nested_runs_unfreeze_when_the_last_ends():
    assert gc.get_freeze_count() == 0
    with frozen_gc():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with frozen_gc():
            pass
        assert gc.get_freeze_count() == frozen  # the inner run's end leaves them frozen
    assert gc.get_freeze_count() == 0


class FakeEngine:
    """Takes every request; a step finishes the oldest one."""

    def __init__(self):
        self.queue, self.frozen_in_steps = [], []
        self.wants_requests = True

    def add_request(self, request):
        self.queue.append(request)

    @property
    def has_work(self):
        return bool(self.queue)

    def step(self):
        self.frozen_in_steps.append(gc.get_freeze_count())
        return [self.queue.pop(0)]


def test_drive_runs_its_steps_frozen():
    engine = FakeEngine()
    assert list(drive(engine, range(3))) == [0, 1, 2]
    assert len(engine.frozen_in_steps) == 3 and all(engine.frozen_in_steps)
    assert gc.get_freeze_count() == 0


def test_an_abandoned_run_unfreezes():
    results = drive(FakeEngine(), range(5))
    assert next(results) == 0 and gc.get_freeze_count() > 0
    results.close()
    assert gc.get_freeze_count() == 0
