"""Which Triton kernel variants a benchmark process compiles, in which phase, and for how long.

Triton compiles a kernel once per specialization (constexprs, and integer arguments equal to 1
or divisible by 16) and keeps the binary in its on-disk cache (~/.triton/cache). A variant that
is first needed in the middle of a timed run stalls it for the compile, ~0.5-2 s each. On the
H200 the first W1 run on a fresh machine (an empty disk cache) reads 20-26 % below the same
engine's run after it, whichever variant runs first, and its warm-up takes 1.1 s against 0.2 s
(`python scripts/bench_throughput.py --workloads W1 --variants batchrun,batchrun` on a fresh
machine): such a row measures the compiler, not the engine.

    log = CompileLog.install()        # None where triton (or its runtime hooks) is missing
    log.phase = "timed"
    ...
    log.summary("timed")              # "2 variants, 1.4 s: _extend_kernel x2"
    log.close()

The hooks see every variant that a process builds in memory, whether Triton compiled it or
loaded it from its disk cache; the seconds tell the two apart (a cache load takes milliseconds).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import NamedTuple


class CompileEvent(NamedTuple):
    phase: str
    kernel: str
    seconds: float
    # Triton's description of the variant: launch options, then each argument's type or
    # specialization (a constexpr's value, an integer's "1" / divisibility)
    detail: str = ""


class CompileLog:
    def __init__(self) -> None:
        self.phase = "start-up"
        self.events: list[CompileEvent] = []
        self._started: dict[str, tuple[float, str]] = {}
        self._saved: tuple | None = None

    @classmethod
    def install(cls) -> CompileLog | None:
        """A log hooked into Triton's JIT (knobs.runtime), or None without it."""
        try:
            from triton import knobs
        except ImportError:
            return None
        runtime = getattr(knobs, "runtime", None)
        hooks = ("jit_cache_hook", "jit_post_compile_hook")
        if runtime is None or not all(hasattr(runtime, name) for name in hooks):
            return None
        log = cls()
        log._saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook = log.before_compile
        runtime.jit_post_compile_hook = log.after_compile
        return log

    def close(self) -> None:
        if self._saved is not None:
            from triton import knobs

            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved
            self._saved = None

    def before_compile(self, *, key=None, repr=None, **_) -> bool:  # noqa: A002 (Triton's name)
        self._started[str(key)] = (time.perf_counter(), str(repr or ""))
        return False  # a true value would tell Triton to skip the compile

    def after_compile(self, *, key=None, fn=None, **_) -> None:
        start, detail = self._started.pop(str(key), (None, ""))
        seconds = 0.0 if start is None else time.perf_counter() - start
        name = getattr(fn, "name", str(fn))
        self.events.append(CompileEvent(self.phase, name, seconds, detail))

    def take(self, phase: str) -> list[CompileEvent]:
        return [e for e in self.events if e.phase == phase]

    def summary(self, phase: str) -> str:
        """'N variants, S s: kernel xK, ...' of one phase ('none' if it built none)."""
        events = self.take(phase)
        if not events:
            return "none"
        counts = Counter(e.kernel for e in events)
        kernels = ", ".join(f"{name} x{n}" if n > 1 else name for name, n in counts.most_common())
        seconds = sum(e.seconds for e in events)
        return f"{len(events)} variants, {seconds:.1f} s: {kernels}"

    def reset(self) -> None:
        self.events.clear()
        self.phase = "start-up"
