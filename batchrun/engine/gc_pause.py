"""Python's cyclic garbage collector, kept off the objects that predate a run, and out of CUDA
graph captures.

`frozen_gc()`: a full (generation 2) collection walks every tracked object in the process: after
loading a model and its tokenizer that is millions, and one such pass stalls the step loop
(docs/benchmarks.md, "What each feature is worth": start-up heap frozen). `gc.freeze()`
moves the objects alive at a run's start into a permanent generation that no collection walks,
so a run's collections only see the run's own objects; `gc.unfreeze()` hands them back when the
last run ends, so nothing that became garbage meanwhile stays uncollected. Reference counting
still frees everything as usual; only cycles wait.

`no_gc()`: a capture records every CUDA call of the process into its graph (torch captures in
the global mode), so a collection that runs inside one may destroy CUDA objects of unrelated
garbage there, e.g. the graphs of an engine dropped earlier in the process: destroying a graph
executable while another stream captures invalidates the capture, and the next launch into it
fails (cuBLAS reports CUBLAS_STATUS_EXECUTION_FAILED, then cudaErrorStreamCaptureInvalidated).
Whether a collection falls inside a capture depends on how many objects the warm-up made, so it
shows up now and then. The guard collects once before the captures and keeps the collector off
until they end.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0  # runs inside frozen_gc(): the objects stay frozen until the last one ends


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    global _depth
    with _lock:
        if _depth == 0:
            gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """No automatic collection inside (CUDA graph captures): one collection first, then the
    collector off until the block ends (as it was before, if it was off already)."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
