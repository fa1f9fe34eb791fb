"""The GPU tier on one GPU, in parallel.

An engine built without `kv_budget` sizes its KV pool from the GPU's free memory
(`gpu_memory_utilization`, 0.85 of it by default): several test processes building such engines
at once take the GPU from each other, and the later ones fail for memory. Here every engine
built in tests/gpu that leaves `gpu_memory_utilization` at its default gets TEST_UTILIZATION of
the free memory instead (tiny models need a small fraction of that) and no start-up compile pool
unless its plan names one, and the tests that need the whole GPU (marked `whole_gpu`:
WHOLE_GPU_FILES) are skipped under pytest-xdist and run in a second, serial command. After each
test the collector runs and torch's cached blocks go back to the driver, so that an engine a test
left behind does not hold memory the other processes need.

Run the tier on one GPU (an H100 or H200) in two commands; where one call of a GPU machine is
limited to 10 minutes, give the second command one or two WHOLE_GPU_FILES at a time (FA3's nvcc
builds alone take minutes on a fresh machine):

    python3 -P -m pytest -q -n 8 --dist loadfile tests/gpu     # all but the whole-GPU tests
    python3 -P -m pytest -q -m whole_gpu tests/gpu             # those, one at a time

BATCHRUN_GPU_FAILURES=FILE appends each failure to FILE as it happens.

Without CUDA every test here skips.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# the share of free GPU memory a test engine's KV pool takes when the test does not size it
TEST_UTILIZATION = 0.05
# files whose tests need the GPU to themselves: default-sized pools for big models, models at
# real widths of tens of GB, a start-up timed on an idle GPU, FlashInfer's FA3 built with nvcc
WHOLE_GPU_FILES = (
    "test_long_context_gpu.py",
    "test_moe_engine_gpu.py",
    "test_gpt_oss_gpu.py",
    "test_cold_start_gpu.py",
    "test_fa3_prefill.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    under_xdist = "PYTEST_XDIST_WORKER" in os.environ
    for item in items:
        path = Path(str(item.fspath))
        if path.parent != here or path.name not in WHOLE_GPU_FILES:
            continue
        item.add_marker(pytest.mark.whole_gpu)
        if under_xdist:
            item.add_marker(
                pytest.mark.skip(
                    reason="needs the whole GPU: run `python3 -P -m pytest -m whole_gpu tests/gpu` "
                    "without -n"
                )
            )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "whole_gpu: needs the GPU to itself (tests/gpu/conftest.py: run without -n)"
    )


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    yield
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _small_default_kv_pool(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """EngineConfig's default gpu_memory_utilization, for this test, is TEST_UTILIZATION (a
    whole_gpu test keeps the real default). EngineConfig objects carry it into engine
    processes, so their engines follow too."""
    if request.node.get_closest_marker("whole_gpu") is not None:
        yield
        return
    from batchrun.config import EngineConfig
    from batchrun.engine import kernel_choice

    # no start-up compile pool unless a test asks for one: eight test processes each starting
    # one would hold a CUDA context a worker (engine/precompile.py)
    monkeypatch.setattr(kernel_choice, "MAX_COMPILE_WORKERS", 0)

    init = EngineConfig.__init__
    code = init.__code__
    names = code.co_varnames[1 : code.co_argcount]
    if init.__kwdefaults__ and "gpu_memory_utilization" in init.__kwdefaults__:
        kwdefaults = {**init.__kwdefaults__, "gpu_memory_utilization": TEST_UTILIZATION}
        monkeypatch.setattr(init, "__kwdefaults__", kwdefaults)
    else:
        defaults = list(init.__defaults__)
        index = names.index("gpu_memory_utilization") - (len(names) - len(defaults))
        defaults[index] = TEST_UTILIZATION
        monkeypatch.setattr(init, "__defaults__", tuple(defaults))
    yield


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With BATCHRUN_GPU_FAILURES set to a file, each failure's report is appended to it as it
    happens (a device call may end before pytest's summary is printed)."""
    path = os.environ.get("BATCHRUN_GPU_FAILURES")
    if not path or not report.failed:
        return
    with open(path, "a") as f:
        f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-3000:]}\n")
