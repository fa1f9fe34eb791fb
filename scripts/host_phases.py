"""Where the engine's main thread spends a step: wraps Engine methods with timers (bench-only
instrumentation; ~1 µs per call) and reports milliseconds per step, plus the GPU's forward
occupancy over the same wall time. Phases nest (a process includes its wait), so they do not sum.
Most of the methods timed are the engine's and the runner's internals (batchrun/engine/
engine.py, model_runner.py), wrapped for measurement only. An object that is missing (no CUDA
graphs on the CPU, no grammar backend before a grammar) is skipped, a method that is missing
raises; tests/e2e/test_bench_scripts.py checks every target against the engine's classes.

    phases = HostPhases(engine)
    ... run ...
    print(phases.report(wall_s, num_steps))     # "schedule 1.10 | launch 0.80 | ..." ms/step
"""

from __future__ import annotations

import time

# (label, object attribute path under the engine, method name)
PHASES = (
    ("admit", "", "_admit_compiled"),
    ("schedule", "scheduler", "schedule"),
    ("fill_wait", "structured", "finish_fill"),
    ("gated_wait", "structured", "finish_gated"),
    ("sample_constrained", "", "_sample_constrained"),
    ("launch", "", "_launch"),
    ("sampling_build", "", "_sampling_batch"),
    # inside launch: the step's inputs staged for the device, then its forward
    ("stage", "runner", "_stage"),
    ("run_forward", "runner", "_run_forward"),
    # inside run_forward: the queued table writes, a decode graph's replay (its input copies,
    # the attention metadata copies and the launch) and an eager forward
    ("table_apply", "runner.req_pool", "apply"),
    ("graph_replay", "runner.graphs", "replay"),
    ("graph_inputs", "runner.graphs.backend", "load_graph_inputs"),
    # a prefill or mixed step through piecewise graphs (engine/piecewise_graph.py)
    ("piecewise_forward", "runner.piecewise", "run"),
    ("eager_forward", "runner.model", "forward"),
    # inside eager_forward: each layer's attention (KV store + kernels; a graph replays these
    # without Python)
    ("eager_attention", "runner.backend", "forward_rotary"),
    ("sample", "runner", "_sample"),
    ("mask_apply", "structured.backend", "apply"),
    ("process", "", "_process"),
    ("wait", "runner", "wait"),
    ("record", "structured", "record"),
    ("start_fill", "structured", "start_fill"),
    ("start_fill_after", "structured", "start_fill_after"),
)


def _existing(owner, name: str):
    """owner.name, or None; a lazy property (`name` backed by `_name`, e.g. the engine's grammar
    backend) that is not built yet stays unbuilt: timing must not create it."""
    if owner is None:
        return None
    if isinstance(getattr(type(owner), name, None), property) and hasattr(owner, f"_{name}"):
        if getattr(owner, f"_{name}") is None:
            return None
    return getattr(owner, name, None)


class MethodTimers:
    """Wraps methods under an object with timers: seconds and calls per label. targets:
    (label, attribute path under root, method name); a path that leads nowhere is skipped."""

    def __init__(self, root, targets, cpu: bool = False):
        self.seconds: dict[str, float] = {label: 0.0 for label, _, _ in targets}
        # cpu: also the calling thread's CPU time per label (time.thread_time, ~1 µs a call):
        # a phase whose CPU time falls short of its wall time is off the CPU (GIL, preempted)
        self.cpu_seconds: dict[str, float] | None = (
            {label: 0.0 for label, _, _ in targets} if cpu else None
        )
        self.calls: dict[str, int] = {label: 0 for label, _, _ in targets}
        # (owner, method name, what owner itself held under that name or None), for close()
        self._wrapped: list[tuple[object, str, object]] = []
        self.labels: list[str] = []  # the targets found and timed
        for label, path, name in targets:
            owner = root
            for part in filter(None, path.split(".")):
                owner = _existing(owner, part)
            if owner is None:  # e.g. no grammar backend: the engine never saw a grammar
                continue
            own = vars(owner).get(name)  # a class's own method; None for an instance
            setattr(owner, name, self._timed(getattr(owner, name), label))
            self._wrapped.append((owner, name, own))
            self.labels.append(label)

    def close(self) -> None:
        """Take the timers off again: an instance's timer that shadows its class's method is
        deleted, a class's own method (a timer on a class) is put back."""
        for owner, name, own in self._wrapped:
            if own is not None:
                setattr(owner, name, own)
            elif name in vars(owner):
                delattr(owner, name)
        self._wrapped = []

    def _timed(self, fn, label):
        seconds, calls, cpu_seconds = self.seconds, self.calls, self.cpu_seconds
        if cpu_seconds is not None:

            def cpu_wrapper(*args, **kwargs):
                t, c = time.perf_counter(), time.thread_time()
                try:
                    return fn(*args, **kwargs)
                finally:
                    cpu_seconds[label] += time.thread_time() - c
                    seconds[label] += time.perf_counter() - t
                    calls[label] += 1

            return cpu_wrapper

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - t
                calls[label] += 1

        return wrapper

    def reset(self) -> None:
        for label in self.seconds:
            self.seconds[label] = 0.0
            self.calls[label] = 0
        if self.cpu_seconds is not None:
            for label in self.cpu_seconds:
                self.cpu_seconds[label] = 0.0


# the host side of every Triton launch (argument binding, specialization, cache lookup, the
# launcher): a class-level timer, so it counts every kernel of every caller
TRITON_LAUNCH = (("triton_launch", "JITFunction", "run"),)


def _thread_switches() -> tuple[int, int]:
    """The calling thread's (voluntary, involuntary) context switches so far; (0, 0) where
    /proc does not say. Voluntary: it blocked (a lock such as the GIL, a sleep, an event wait);
    involuntary: the kernel took its CPU away."""
    counts = {}
    try:
        with open("/proc/thread-self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.endswith("ctxt_switches"):
                    counts[key] = int(value)
    except (OSError, ValueError):
        pass
    return counts.get("voluntary_ctxt_switches", 0), counts.get("nonvoluntary_ctxt_switches", 0)


class HostPhases(MethodTimers):
    """cpu: also each phase's CPU time on the calling thread, and that thread's CPU time and
    context switches over the whole window (take() on the thread that runs the engine)."""

    def __init__(self, engine, phases=PHASES, cpu: bool = False):
        super().__init__(engine, phases, cpu=cpu)
        self.engine = engine
        self._forward0 = engine.runner.forward_time
        self._cpu0 = time.thread_time()
        self._process_cpu0 = time.process_time()
        self._switches0 = _thread_switches()
        self._triton = None
        if engine.runner.device.type == "cuda":
            try:
                import triton.runtime.jit as jit
            except ImportError:
                pass
            else:
                self._triton = MethodTimers(jit, TRITON_LAUNCH)
                self.seconds["triton_launch"] = self.calls["triton_launch"] = 0

    def close(self) -> None:
        super().close()
        if self._triton is not None:
            self._triton.close()
            self._triton = None

    def reset(self) -> None:
        super().reset()
        if getattr(self, "_triton", None) is not None:
            self._triton.reset()

    def take(self, wall_s: float, num_steps: int) -> dict:
        """ms per step of each phase since the last take(), and the GPU forward occupancy."""
        steps = max(num_steps, 1)
        if self._triton is not None:
            self.seconds["triton_launch"] = self._triton.seconds["triton_launch"]
            self.calls["triton_launch"] = self._triton.calls["triton_launch"]
        out = {label: 1e3 * s / steps for label, s in self.seconds.items()}
        if self._triton is not None:
            out["triton_launches"] = self.calls["triton_launch"] / steps  # a count, not ms
        forward = self.engine.runner.forward_time
        out["gpu_forward_ms"] = 1e3 * (forward - self._forward0) / steps
        out["occupancy"] = (forward - self._forward0) / wall_s if wall_s else 0.0
        self._forward0 = forward
        cpu, switches, process_cpu = time.thread_time(), _thread_switches(), time.process_time()
        if self.cpu_seconds is not None:
            # every thread of the process: the step loop, the fill job, xgrammar's C++ threads
            out["process_cpu_ms"] = 1e3 * (process_cpu - self._process_cpu0) / steps
            out["cpu"] = {label: 1e3 * s / steps for label, s in self.cpu_seconds.items()}
            out["main_cpu_ms"] = 1e3 * (cpu - self._cpu0) / steps
            out["main_cpu_share"] = (cpu - self._cpu0) / wall_s if wall_s else 0.0
            out["voluntary_switches"] = (switches[0] - self._switches0[0]) / steps
            out["involuntary_switches"] = (switches[1] - self._switches0[1]) / steps
        self._cpu0, self._switches0, self._process_cpu0 = cpu, switches, process_cpu
        self.reset()
        return out

    @staticmethod
    def format(phases: dict) -> str:
        """One line: ms per step by phase, then (cpu=True) a second with each phase's CPU time."""
        line = (
            " | ".join(
                f"{k} {v:.2f}"
                for k, v in phases.items()
                if k != "occupancy" and isinstance(v, float) and v >= 0.005
            )
            + f" | occupancy {phases['occupancy']:.2f}"
        )
        if "cpu" in phases:
            line += "\n  main thread CPU ms/step: " + " | ".join(
                f"{k} {v:.2f}" for k, v in phases["cpu"].items() if v >= 0.005
            )
        return line
