"""W4 of BENCH.md: structured output overhead. 1,000 prompts with a JSON schema against the same
prompts unconstrained, in one process on one engine; output tok/s of both and the overhead.

    python scripts/bench_structured.py                          # W4 on the H200 (llama-1b)
    python scripts/bench_structured.py --model llama-8b
    python scripts/bench_structured.py --device cpu --model tiny --num-prompts 16 \
        --prompt-len 32 --output-len 32                         # CPU smoke test

The model has dummy weights (config.json from benchlib.py) and the embedded SmolLM2
tokenizer (the grammar needs one; no download): its 49,152 ids are the only ones a grammar may
allow, ids above stay masked. NOTE: the host's grammar work per token (accept, bitmask fill)
grows with the tokenizer; a real Llama-3 tokenizer (128k ids) costs more than this one. The
per-step host times printed show how much room is left. Random weights write garbage, but
grammar-valid garbage: string fields rarely close, so most constrained rows run to
--output-len, like the unconstrained ones (ignore_eos). Both runs are warmed up first (CUDA
graphs, the compile, Triton's JIT), then timed alternately --repeats times; the medians are
shown. The engine options are bench_throughput's (--attention-backend, --kernel FIELD=VALUE,
...; the resolved KernelPlan goes into the JSON). Prints a markdown row for BENCH.md and
writes the figures as JSON under --out.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import benchlib
import msgspec
import torch
from benchlib import MODELS, random_tokens
from host_phases import HostPhases, MethodTimers

from batchrun.engine import grammar as grammar_module
from batchrun.engine.engine import Engine
from batchrun.models.embedded import resolve_model_path
from batchrun.params import GenerateRequest, GrammarSpec, SamplingParams

MODES = ("default", "no-piecewise")  # --modes

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "active": {"type": "boolean"},
        "kind": {"enum": ["person", "place", "thing"]},
        "summary": {"type": "string"},
    },
    "required": ["id", "name", "tags", "active", "kind", "summary"],
}


def model_dir(name: str, root: Path, tokenizer_dir: Path | None = None) -> Path:
    """Dummy-weight model dir with the embedded SmolLM2 tokenizer (EOS 2, BOS 1), copied from
    tokenizer_dir when given (a machine without the embedded model's package: its tokenizer
    files alone are enough)."""
    path = benchlib.write_model_dir(name, root)
    config = json.loads((path / "config.json").read_text())
    # the tokenizer's ids must fit the logits; ours end at 49,152 (the tiny shape is smaller)
    config["vocab_size"] = max(config["vocab_size"], 49152)
    config.update(bos_token_id=1, eos_token_id=2)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    embedded = tokenizer_dir or resolve_model_path(None)
    for f in embedded.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, path / f.name)
    return path


class HostClock:
    """Host seconds in the grammar's per-step work (timers on the engine's grammar backend and
    StructuredOutput; bench-only instrumentation): the fill job on the fill thread (the
    matchers accepting the last step's tokens, then the bitmask fill), overlapping the next
    step's scheduling, and how long the main thread still waits for it (the part of the job
    that is not hidden). Per fill job (finish_fill call)."""

    TARGETS = (
        ("accept", "structured.backend", "accept_tokens"),
        ("fill", "structured.backend", "fill_rows"),
        ("fill_wait", "structured", "finish_fill"),
        # gated (CUDA with overlap): the device waits for the job, the main thread only
        # collects its rejections once the step's tokens are here
        ("gated_wait", "structured", "finish_gated"),
    )

    def __init__(self, engine):
        self.timers = MethodTimers(engine, self.TARGETS)

    def take(self) -> dict:
        seconds, calls = self.timers.seconds, self.timers.calls
        n = max(calls["fill_wait"] + calls["gated_wait"], 1)  # fill jobs
        out = {f"{label}_ms_per_step": 1e3 * seconds[label] / n for label, _, _ in self.TARGETS}
        self.timers.reset()
        return out


def gate_stats(before, after) -> dict:
    """The device's time at the host gate and in the bitmask copy, per gated step."""
    n = max(after.num_gated_steps - before.num_gated_steps, 1)
    return {
        "gated_steps": after.num_gated_steps - before.num_gated_steps,
        "gate_wait_ms_per_step": 1e3 * (after.gate_wait_time - before.gate_wait_time) / n,
        "mask_copy_ms_per_step": 1e3 * (after.mask_copy_time - before.mask_copy_time) / n,
    }


def run_once(engine, prompts, params, sync, phases: HostPhases | None = None) -> dict:
    requests = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    reasons: Counter = Counter()
    tokens = 0
    sync()
    steps0 = engine.stats.num_steps
    t0 = time.perf_counter()
    for result in engine.generate(requests):
        reasons[result.finish_reason] += 1
        tokens += result.completion_tokens
    sync()
    wall = time.perf_counter() - t0
    steps = engine.stats.num_steps - steps0
    return {
        "phases_ms_per_step": phases.take(wall, steps) if phases else None,
        "wall_s": wall,
        "output_tokens": tokens,
        "tok_s": tokens / wall,
        "ms_per_step": 1e3 * wall / max(steps, 1),
        "finish": reasons,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama-1b", help=f"of {', '.join(MODELS)}")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--schema", type=Path, default=None, help="JSON schema file (default: built in)")
    p.add_argument(
        "--tokenizer", type=Path, default=None,
        help="directory with the SmolLM2 tokenizer files (default: the embedded model's)",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=3)
    benchlib.add_engine_args(p)
    p.add_argument("--no-overlap", action="store_true")
    p.add_argument(
        "--fill-threads", type=int, default=None,
        help="C++ threads of the bitmask fill (default: batchrun's FILL_THREADS)",
    )  # fmt: skip
    p.add_argument(
        "--fill", default=None,
        help="bitmask fill settings THREADSxSHARDS, comma-separated (e.g. 4x1,1x2): each "
        "repeat runs the JSON schema once per setting, after one unconstrained run",
    )  # fmt: skip
    p.add_argument(
        "--switch-interval-ms", type=float, default=None,
        help="the GIL switch interval while grammars run (default: batchrun's GIL_SWITCH_S)",
    )  # fmt: skip
    p.add_argument(
        "--modes", default="default",
        help=f"comma-separated, of {', '.join(MODES)}: each repeat runs every mode (the engine's "
        "defaults; prefill and mixed steps without piecewise CUDA graphs)",
    )  # fmt: skip
    p.add_argument(
        "--phases", action="store_true",
        help="time the main thread's phases per step (scripts/host_phases.py) and print them",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=benchlib.OUT_DIR)
    args = p.parse_args(argv)

    # knobs to measure other settings against the defaults (read when the backend is made)
    if args.fill_threads is not None:
        grammar_module.FILL_THREADS = args.fill_threads
    if args.switch_interval_ms is not None:
        grammar_module.GIL_SWITCH_S = args.switch_interval_ms / 1e3
        sys.setswitchinterval(grammar_module.GIL_SWITCH_S)  # also when it is above the default

    is_cuda = args.device == "cuda"
    benchlib.set_engine_threads(args.device)
    sync = torch.cuda.synchronize if is_cuda else (lambda: None)
    schema = json.loads(args.schema.read_text()) if args.schema else SCHEMA
    rng = random.Random(4)
    prompts = [random_tokens(rng, args.prompt_len) for _ in range(args.num_prompts)]
    free = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    grammar = GrammarSpec("json_schema", json.dumps(schema))
    constrained = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, grammar=grammar)

    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(args.model, Path(tmp), args.tokenizer)
        t = time.perf_counter()
        config = benchlib.engine_config(args, path, overlap=not args.no_overlap)
        engine = Engine(config, benchlib.kernel_plan(args))
        startup = time.perf_counter() - t
        print(f"kernels: {engine.kernels.describe()}", flush=True)
        # warm-up: CUDA graphs, the grammar compile, Triton's JIT (other prompts: no cache hits).
        # NOTE: a full batch of distinct prompts, so that the prefill chunks and the decode
        # steps have the timed runs' shapes, and every kernel variant they need is built here
        # (a variant first built inside a timed run stalls it: scripts/triton_compiles.py)
        num_warm = min(engine.config.max_running, args.num_prompts)
        warm = [random_tokens(rng, args.prompt_len) for _ in range(num_warm)]
        t = time.perf_counter()
        for params in (free, constrained):
            run_once(engine, warm, msgspec.structs.replace(params, max_new_tokens=16), sync)
        warmup = time.perf_counter() - t
        clock = HostClock(engine)
        phases = HostPhases(engine, cpu=True) if args.phases else None
        if phases:
            phases.take(1.0, 1)  # drop the warm-up's share
        backend = engine.grammar
        default_fill = f"{backend.fill_threads}x{backend.fill_shards}"
        settings = args.fill.split(",") if args.fill else [default_fill]
        modes = args.modes.split(",")
        if not set(modes) <= set(MODES):
            p.error(f"--modes takes {', '.join(MODES)}; got {args.modes!r}")
        # NOTE: the no-piecewise mode detaches the runner's piecewise graph runner (an internal,
        # for measurement only) for its runs: one engine serves both modes, alternating, where a
        # second engine would have to share the first one's KV memory
        piecewise = engine.runner.piecewise

        def key(name: str, mode: str) -> str:  # the mode is named only when several run
            return f"{name} {mode}" if len(modes) > 1 else name

        runs: dict[str, list[dict]] = {}
        plan = []
        for mode in modes:
            plan.append((key("free", mode), free, None, mode))
            plan += [(key(f"json_schema {s}", mode), constrained, s, mode) for s in settings]
        runs = {name: [] for name, *_ in plan}
        for _ in range(args.repeats):
            for name, params, setting, mode in plan:
                engine.runner.piecewise = None if mode == "no-piecewise" else piecewise
                if setting is not None:
                    threads, shards = (int(x) for x in setting.split("x"))
                    backend.set_fill_parallelism(threads, shards)
                engine.kv.cache.reset()  # a cold prefix cache for every timed run
                stats0 = copy.copy(engine.stats)
                res = run_once(engine, prompts, params, sync, phases)
                res.update(clock.take())
                res.update(gate_stats(stats0, engine.stats))
                runs[name].append(res)
                print(
                    f"{name:18s} {res['tok_s']:10,.0f} out tok/s  {res['output_tokens']:,} "
                    f"tokens in {res['wall_s']:.2f} s  {res['ms_per_step']:.2f} ms/step (grammar "
                    f"work per step on the fill thread: accept {res['accept_ms_per_step']:.2f} ms, "
                    f"fill {res['fill_ms_per_step']:.2f} ms; main thread waited for it "
                    f"{res['fill_wait_ms_per_step'] + res['gated_wait_ms_per_step']:.2f} ms; "
                    f"device waited at the gate {res['gate_wait_ms_per_step']:.3f} ms, mask copy "
                    f"{res['mask_copy_ms_per_step']:.3f} ms)  finish {dict(res['finish'])}",
                    flush=True,
                )
                if phases:
                    print(f"  main thread ms/step: {HostPhases.format(res['phases_ms_per_step'])}")

    device = torch.cuda.get_device_name() if is_cuda else "cpu"
    print(f"\nmodel {args.model} on {device}; start-up {startup:.1f} s, warm-up {warmup:.1f} s")
    print(
        "| workload | fill threads x shards | unconstrained, output tok/s "
        "| JSON schema, output tok/s | overhead |"
    )
    print("|---|---|---|---|---|")
    overheads = {}
    for mode in modes:
        free_mode = statistics.median(r["tok_s"] for r in runs[key("free", mode)])
        for setting in settings:
            label = key(setting, mode)
            json_tok_s = statistics.median(
                r["tok_s"] for r in runs[key(f"json_schema {setting}", mode)]
            )
            overhead = overheads[label] = 100.0 * (free_mode - json_tok_s) / free_mode
            print(
                f"| W4, {args.model}, {args.num_prompts} x {args.prompt_len} in, "
                f"{args.output_len} out | {label} | {free_mode:,.0f} | {json_tok_s:,.0f} | "
                f"{overhead:.1f} % (target <= 10 %) |"
            )
    free_tok_s = statistics.median(r["tok_s"] for r in runs[key("free", modes[0])])
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "model": args.model,
        "device": device,
        "args": {k: str(v) for k, v in vars(args).items()},
        "kernels": dataclasses.asdict(engine.kernels),
        "free_tok_s": free_tok_s,
        # THREADSxSHARDS; runs are keyed "json_schema SETTING" (and " MODE" with several modes)
        "fill_settings": settings,
        "modes": modes,
        # the first setting's figures (the engine's default when --fill is not given)
        "json_schema_tok_s": statistics.median(
            r["tok_s"] for r in runs[key(f"json_schema {settings[0]}", modes[0])]
        ),
        "overhead_pct": overheads[key(settings[0], modes[0])],
        "overhead_pct_by_fill": overheads,
        "runs": {k: [{**r, "finish": dict(r["finish"])} for r in v] for k, v in runs.items()},
    }
    (args.out / "bench_structured.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
