"""An engine that takes its time: batchrun's Engine with a pause before every step, so that a
test can watch a run while it goes. Built in the engine process through EngineProcess's
`engine_factory` hook (importable there: the engine process gets this process's sys.path)."""

from __future__ import annotations

import time

STEP_PAUSE_S = 0.05


def slow_engine(config, device_index):
    from batchrun.engine.engine import Engine

    engine = Engine(config)
    step = engine.step

    def slow_step():
        time.sleep(STEP_PAUSE_S)
        return step()

    engine.step = slow_step
    return engine
