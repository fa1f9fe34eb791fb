"""A signal that arrives after the run is over (e.g. Slurm's USR1 right after a drain) exits
with the run's own code, not with the default action's death by signal."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import os, signal, sys
from batchrun.job.signals import StopSignals
stop = StopSignals().install()
stop.finish(int(sys.argv[1]))
os.kill(os.getpid(), signal.SIGUSR1)
signal.pause()
"""


@pytest.mark.parametrize("code", [0, 5])
def test_late_signal_exits_with_the_runs_code(code):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(code)], timeout=60)
    assert proc.returncode == code
