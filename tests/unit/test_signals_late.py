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


# a signal during the interpreter's teardown: after its exit handlers, when Python has put the
# default actions back, while the modules go (an object's finalizer sends it here)
TEARDOWN = """
import os, signal, sys, time
from batchrun.job.signals import StopSignals

class SignalAtTeardown:
    def __init__(self, signum, kill=os.kill, getpid=os.getpid, sleep=time.sleep):
        self.send = lambda: kill(getpid(), signum)
        self.sleep = sleep

    def __del__(self):
        self.send()
        self.sleep(0.2)

stop = StopSignals().install()
stop.finish(int(sys.argv[1]))
kept = SignalAtTeardown(getattr(signal, sys.argv[2]))
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM", "SIGUSR1"])
def test_a_signal_during_teardown_keeps_the_runs_code(name, tmp_path):
    # a script file: under -c the finalizer runs before the default actions come back
    script = tmp_path / "teardown.py"
    script.write_text(TEARDOWN)
    proc = subprocess.run([sys.executable, str(script), "5", name], timeout=60)
    assert proc.returncode == 5
