"""Our Triton kernels' start-up compiles, run in parallel in worker processes.

On a machine with an empty Triton cache (a fresh node or container) the decode graphs' capture
compiles every kernel variant it meets, one after another, in the engine's process. Here the
capture's warm-up forwards run once first as a dry pass: Triton's compile hook records each
variant it is about to compile (its `specialization_data`) and tells Triton to skip it, which
also skips the launch; the recorded variants are then compiled by a pool of worker processes
(`JITFunction.preload`, which writes Triton's on-disk cache), and the real capture that follows
loads each binary from that cache. The pool is started when the engine starts, so that its
processes import torch and Triton while the weights load.

    pool = CompilePool.start(workers)             # None with 0 workers
    with pool.recording() as variants:            # a dry pass: nothing launches
        model(batch, backend)
    pool.compile(variants)                        # in parallel, into the disk cache; closes
    pool.close()                                  # (a pool never asked to compile)

A dry pass runs the forwards' torch operations on whatever the skipped kernels left in their
outputs; nothing on it reads a tensor on the host. A variant a worker cannot rebuild (a kernel
that is not a module-level name, a Triton without the hook or `preload`) is compiled where the
capture meets it, as without the pool. Each worker holds a CUDA context while it compiles
(Triton's `preload` asks the device for its target). The rule for the number of workers:
engine/kernel_choice.py's compile_rule.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)


def supported() -> bool:
    """Whether this Triton has the compile hook and `preload` the pool rests on."""
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    return hasattr(runtime, "jit_cache_hook") and hasattr(JITFunction, "preload")


def _resolve(module: str, name: str):
    from triton.runtime.jit import JITFunction

    obj = getattr(importlib.import_module(module), name)
    while not isinstance(obj, JITFunction):  # an autotuner or heuristics wraps the JITFunction
        obj = obj.fn
    return obj


def _serve() -> None:
    """A worker: imports torch and Triton, then compiles the variants of the one JSON list it
    reads on stdin (module, kernel name, specialization data) into Triton's disk cache, and
    prints one JSON line: how many compiled, and the first error."""
    import torch  # noqa: F401
    import triton  # noqa: F401

    done, error = 0, None
    for module, name, data in json.loads(sys.stdin.read() or "[]"):
        try:
            _resolve(module, name).preload(data)
            done += 1
        except Exception as e:  # noqa: BLE001 (reported; the capture compiles the variant)
            error = error or f"{module}.{name}: {type(e).__name__}: {e}"
    print(json.dumps({"compiled": done, "error": error}), flush=True)


class CompilePool:
    """Worker processes of `python -m batchrun.engine.precompile` (their own interpreters: no
    re-import of the caller's main module, as multiprocessing's spawn would do)."""

    def __init__(self, workers: int):
        flags = ["-P"] if sys.version_info >= (3, 11) else []
        self.procs = [
            subprocess.Popen(
                [sys.executable, *flags, "-m", __name__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )  # fmt: skip
            for _ in range(workers)
        ]

    @classmethod
    def start(cls, workers: int) -> CompilePool | None:
        if workers <= 0 or not supported():
            return None
        return cls(workers)

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[tuple[str, str, str]]]:
        """Within: every Triton variant that would compile is recorded instead, and neither
        compiled nor launched."""
        from triton import knobs

        variants: list[tuple[str, str, str]] = []
        seen: set[str] = set()

        def hook(*, fn=None, compile=None, **_) -> bool:  # noqa: A002 (Triton's name)
            data = compile["specialization_data"]
            if data not in seen:
                seen.add(data)
                variants.append((fn.module, fn.name, data))
            return True  # skip the compile (and so the launch)

        saved = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = hook
        try:
            yield variants
        finally:
            knobs.runtime.jit_cache_hook = saved

    def compile(self, variants: list[tuple[str, str, str]]) -> None:
        """Compile the variants across the workers (round-robin) and wait for them all; what a
        worker could not compile is logged and left to the capture."""
        t0 = time.perf_counter()
        n = len(self.procs)
        for i, proc in enumerate(self.procs):
            try:
                proc.stdin.write(json.dumps(variants[i::n]))
                proc.stdin.close()
            except OSError:  # the worker died while starting: its variants go to the capture
                pass
        compiled, errors = 0, []
        for proc in self.procs:
            try:
                reply = json.loads(proc.stdout.readline() or "{}")
            except ValueError:
                reply = {}
            compiled += reply.get("compiled", 0)
            if reply.get("error") or "compiled" not in reply:
                errors.append(reply.get("error") or f"worker exited with {proc.wait()}")
        self.close()
        if errors:
            log.warning(
                "%d of %d Triton variants did not compile in the start-up pool (the capture "
                "compiles them): %s", len(variants) - compiled, len(variants), errors[0],
            )  # fmt: skip
        log.info(
            "compiled %d Triton variants in %d processes in %.1f s",
            compiled, n, time.perf_counter() - t0,
        )  # fmt: skip

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
                proc.kill()
            proc.wait()
            proc.stdout.close()


if __name__ == "__main__":
    _serve()
