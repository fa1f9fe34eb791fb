"""Output tok/s of the batchrun engine vs HF transformers `generate`, in the same run, on the CPU.

    python scripts/bench_cpu_engine_vs_hf.py                      # 32 chat prompts x 64 tokens
    python scripts/bench_cpu_engine_vs_hf.py --out bench.md --threads 2

Both sides run the embedded SmolLM2-135M-Instruct in float32 on the same token ids (the chat
template applied once), greedy, and produce exactly --new-tokens tokens per prompt (EOS is masked
until then: min_new_tokens on both sides). HF runs left-padded static batches of --hf-batch-size.
Both are warmed up with a tiny run, then timed --repeats times, alternating, and the median is
reported. The engine's radix cache is emptied before each timed run, so every run starts cold
(within a run it still shares the chat template's common system-prompt prefix, as it would in a
real job). Absolute figures from a CPU machine mean little (BENCH.md); the ratio is the point.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import benchlib
import torch
from benchlib import ROOT, greedy_params, hf_generate

from batchrun.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.params import GenerateRequest


def load_conversations(num_prompts: int) -> list[list[dict]]:
    """Chat conversations from the example files; distinct ones beyond those by numbering."""
    convs: list[list[dict]] = []
    for line in (ROOT / "examples" / "prompts.jsonl").read_text().splitlines():
        row = json.loads(line)
        convs.append(row.get("messages") or [{"role": "user", "content": row["prompt"]}])
    for line in (ROOT / "examples" / "openai_batch.jsonl").read_text().splitlines():
        convs.append(json.loads(line)["body"]["messages"])
    out = []
    for i in range(num_prompts):
        conv = [dict(m) for m in convs[i % len(convs)]]
        if i >= len(convs):  # keep prompts distinct so no run is served from the prefix cache
            conv[-1]["content"] = f"({i // len(convs)}) {conv[-1]['content']}"
        out.append(conv)
    return out


# -- the two sides -----------------------------------------------------------------------------


def run_engine(engine: Engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = greedy_params(new_tokens)
    requests = [GenerateRequest(str(i), ids, params) for i, ids in enumerate(prompts)]
    outputs: dict[str, list[int]] = {}
    for result in engine.generate(requests):
        if result.error or result.completion_tokens != new_tokens:
            raise RuntimeError(f"engine request {result.rid}: {result}")
        outputs[result.rid] = result.output_ids
    return [outputs[str(i)] for i in range(len(prompts))]


@torch.inference_mode()
def run_hf(
    model, prompts: list[list[int]], new_tokens: int, batch_size: int, pad_id: int
) -> list[list[int]]:
    outputs: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        out, width = hf_generate(model, prompts[start : start + batch_size], new_tokens, pad_id)
        new = out[:, width:]
        if new.shape[1] != new_tokens:
            raise RuntimeError(f"HF generated {new.shape[1]} tokens, expected {new_tokens}")
        outputs.extend(new.tolist())
    return outputs


def common_prefix_len(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def timed(fn, cpu_util: list[float]) -> tuple[float, object]:
    """Wall seconds and result; appends process CPU time / wall (about `threads` when the
    machine is quiet, much less when other processes compete for the cores)."""
    c0, t0 = time.process_time(), time.perf_counter()
    result = fn()
    wall = time.perf_counter() - t0
    cpu_util.append((time.process_time() - c0) / wall)
    return wall, result


# -- main --------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--hf-batch-size", type=int, default=32, help="HF static batch (32: one padded batch)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (both sides)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per side")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    env = benchlib.environment("cpu")  # read before the run: the engine code is imported now
    torch.manual_seed(0)

    t0 = time.perf_counter()
    # NOTE: an explicit KV budget: the CPU default takes a quarter of free memory (GBs), far more
    # than num_prompts x (prompt + new tokens) needs; 512 tokens per prompt is plenty here.
    kv_budget = max(4096, args.num_prompts * (512 + args.new_tokens))
    engine = Engine(EngineConfig(model=None, device="cpu", kv_budget=kv_budget))
    print(f"kernels: {engine.kernels.describe()}", flush=True)
    tok = engine.tokenizer
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(engine.model_dir), dtype=torch.float32).eval()
    startup = time.perf_counter() - t0
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    # as batchrun's tokenize step does it: template to text, then encode without extra specials
    texts = [
        tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        for conv in load_conversations(args.num_prompts)
    ]
    prompts = [list(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
    prompt_lens = [len(p) for p in prompts]
    num_out = args.num_prompts * args.new_tokens
    print(
        f"start-up {startup:.1f}s; {args.num_prompts} prompts, {sum(prompt_lens)} prompt tokens "
        f"(min {min(prompt_lens)}, max {max(prompt_lens)}), {args.new_tokens} new tokens each; "
        f"torch threads {threads}; HF attention {hf.config._attn_implementation}",
        flush=True,
    )

    # warm-up: a tiny run on each side (allocator, oneDNN primitives, lazy imports)
    run_engine(engine, prompts[:2], 4)
    run_hf(hf, prompts[:2], 4, 2, pad_id)
    engine.kv.cache.reset()

    engine_times, hf_times, utils = [], [], []
    engine_out = hf_out = None
    cached_fraction = forward_fraction = 0.0
    for rep in range(args.repeats):
        engine.kv.cache.reset()  # idle engine: every timed run starts with a cold prefix cache
        before = (engine.stats.prompt_tokens, engine.stats.cached_tokens, engine.stats.forward_time)
        secs, engine_out = timed(lambda: run_engine(engine, prompts, args.new_tokens), utils)
        engine_times.append(secs)
        prompt_toks = engine.stats.prompt_tokens - before[0]
        cached_fraction = (engine.stats.cached_tokens - before[1]) / max(prompt_toks, 1)
        forward_fraction = (engine.stats.forward_time - before[2]) / secs
        print(
            f"  run {rep + 1}: engine {secs:6.2f}s = {num_out / secs:7.1f} tok/s "
            f"(forward+sample {forward_fraction:.0%} of wall, prompt cached {cached_fraction:.0%}, "
            f"cpu util {utils[-1]:.2f})",
            flush=True,
        )
        secs, hf_out = timed(
            lambda: run_hf(hf, prompts, args.new_tokens, args.hf_batch_size, pad_id), utils
        )
        hf_times.append(secs)
        print(
            f"  run {rep + 1}: HF     {secs:6.2f}s = {num_out / secs:7.1f} tok/s "
            f"(cpu util {utils[-1]:.2f})",
            flush=True,
        )

    engine_tps = num_out / statistics.median(engine_times)
    hf_tps = num_out / statistics.median(hf_times)
    # fp32 on both sides, but different kernels and padding: greedy paths may part late
    pairs = list(zip(engine_out, hf_out, strict=True))
    same = sum(a == b for a, b in pairs)
    agree = statistics.mean(common_prefix_len(a, b) / len(a) for a, b in pairs)

    table = "\n".join(
        [
            f"CPU: batchrun engine vs HF `generate`, SmolLM2-135M-Instruct fp32, "
            f"{args.num_prompts} chat prompts x {args.new_tokens} new tokens, greedy",
            "",
            "| engine tok/s | HF tok/s | ratio | torch threads | HF batch | date | commit |",
            "|---|---|---|---|---|---|---|",
            f"| {engine_tps:.1f} | {hf_tps:.1f} | {engine_tps / hf_tps:.2f}x | {threads} "
            f"| {args.hf_batch_size} | {env['date'][:10]} | {env['commit']} |",
            "",
            f"median of {args.repeats} runs each; engine runs "
            + ", ".join(f"{t:.2f}s" for t in engine_times)
            + "; HF runs "
            + ", ".join(f"{t:.2f}s" for t in hf_times)
            + f"; CPU util (process CPU s / wall s, ~{threads} when quiet) "
            + ", ".join(f"{u:.2f}" for u in utils)
            + f"; engine prompt tokens from the prefix cache {cached_fraction:.0%}; "
            f"identical greedy outputs {same}/{args.num_prompts} "
            f"(mean agreeing prefix {agree:.0%}); "
            f"torch {env['torch']}, {env['cpu']}, command: `{env['command']}`",
        ]
    )
    print()
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
