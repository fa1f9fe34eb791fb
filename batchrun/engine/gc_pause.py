"""Python's cyclic garbage collector, kept off the objects that predate a run.

A full (generation 2) collection walks every tracked object in the process: after loading a
model and its tokenizer that is millions, and one such pass took 162 ms right at the start of a
timed W1 llama-8b run, before its first launch (H200, docs/benchmarks.md, seventeenth session).
`gc.freeze()` moves the objects alive at a run's start into a permanent generation that no
collection walks, so a run's collections only see the run's own objects; `gc.unfreeze()` hands
them back when the last run ends, so nothing that became garbage meanwhile stays uncollected.
Reference counting still frees everything as usual; only cycles wait.
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
