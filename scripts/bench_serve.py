"""`batchrun serve` against `batchrun submit`: one chat batch (OpenAI Batch input), same file, same
engine options, same run, wall time each; and the server's cost per request while it runs.

    python scripts/bench_serve.py --model llama-8b --rows 5000 --device cuda          # the GPU
    python scripts/bench_serve.py --embedded --device cpu --rows 6 --max-tokens 4    # smoke

submit: `batchrun submit FILE --out DIR` in a subprocess, timed from its start to its exit (model
load included). serve: a server started on loopback first (untimed: it loads no model until a
batch needs one), then timed from the upload to the downloaded output file through the official
`openai` client (the model load is in this part too), polling GET /v1/batches/{id} every
--poll-s; a second thread polls --probe-hz times a second meanwhile (many clients' polling,
spread out) and gives the latency of that GET (p50 / p99). submit's wall includes its Python
start-up (imports), which the running server has behind it. The models are benchlib's Llama
shapes with dummy weights and a byte-level tokenizer with a ChatML template (written beside
config.json), or the embedded SmolLM2. Greedy: both runs give the same texts, which the script
checks. Prints a markdown table and writes $OUT/bench_serve.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import benchlib

from batchrun.job.config import EMBEDDED_SERVED_NAME

SYSTEM = "You are a careful assistant. Answer in one short paragraph."
TOPICS = ["rivers", "bridges", "tides", "violins", "glaciers", "printing", "salt", "orbits"]


def write_tokenizer(path: Path) -> None:
    """A byte-level tokenizer (ids 0..255 bytes, then the ChatML specials) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(ByteLevel.alphabet(), key=ord)
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<s>", "<pad>"])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(path)


def write_batch(path: Path, rows: int, max_tokens: int, model: str) -> None:
    with path.open("w") as f:
        for i in range(rows):
            question = f"Tell me about {TOPICS[i % len(TOPICS)]}, item {i}, in plain words."
            body = {
                "model": model,
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": question},
                ],
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            line = {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions"}
            f.write(json.dumps({**line, "body": body}) + "\n")


def texts(lines) -> dict[str, str]:
    out = {}
    for line in lines:
        r = json.loads(line)
        if r.get("response"):
            out[r["custom_id"]] = r["response"]["body"]["choices"][0]["message"]["content"]
    return out


def run_submit(cmd: list[str], batch: Path, out: Path, engine: list[str]) -> tuple[float, dict]:
    t = time.perf_counter()
    subprocess.run([*cmd, "submit", str(batch), "--out", str(out), "--quiet", *engine], check=True)
    wall = time.perf_counter() - t
    lines = []
    for p in sorted(out.glob("results-*.jsonl")):
        lines += p.read_text().splitlines()
    return wall, texts(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd, data: Path, port: int, name: str, model: str | None, engine, log):
    argv = [*cmd, "serve", "--data-dir", str(data), "--port", str(port), *engine]
    if model is not None:
        argv += ["--model", f"{name}={model}"]
    proc = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/files", timeout=5)
            return proc
        except OSError:
            time.sleep(0.2)
    raise SystemExit("the server did not answer in 300 s")


def run_serve(
    base_url: str, batch: Path, poll_s: float, probe_hz: float
) -> tuple[float, dict, list[float]]:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=600)
    latencies: list[float] = []
    running = threading.Event()
    t = time.perf_counter()
    upload = client.files.create(file=batch.open("rb"), purpose="batch")
    job = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    def probe() -> None:  # the GET's own cost, while the batch runs
        c = OpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=60)
        while running.is_set():
            s = time.perf_counter()
            c.batches.retrieve(job.id)
            latencies.append(time.perf_counter() - s)
            time.sleep(max(0.0, 1 / probe_hz - (time.perf_counter() - s)))

    running.set()
    prober = threading.Thread(target=probe, daemon=True)
    if probe_hz > 0:
        prober.start()
    while job.status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(poll_s)
        job = client.batches.retrieve(job.id)
    running.clear()
    if job.status != "completed":
        raise SystemExit(f"the batch ended {job.status}: {job.errors}")
    content = client.files.content(job.output_file_id).text
    wall = time.perf_counter() - t
    if probe_hz > 0:
        prober.join()
    return wall, texts(content.splitlines()), latencies


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-8b", help="a benchlib shape (dummy weights)")
    ap.add_argument("--embedded", action="store_true", help="the embedded SmolLM2 instead")
    ap.add_argument("--rows", type=int, default=5000)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--poll-s", type=float, default=1.0, help="the client's poll interval")
    ap.add_argument("--probe-hz", type=float, default=20.0, help="GETs a second (0: none)")
    ap.add_argument("--engine-arg", action="append", default=[], help="more engine options")
    args = ap.parse_args(argv)
    cmd = [sys.executable, "-m", "batchrun.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, name = None, EMBEDDED_SERVED_NAME
        engine = ["--device", args.device, "--dp", str(args.dp), *args.engine_arg]
        if not args.embedded:
            model, name = str(benchlib.write_model_dir(args.model, tmp)), args.model
            write_tokenizer(Path(model))
            engine += ["--load-format", "dummy"]
        batch = tmp / "batch.jsonl"
        write_batch(batch, args.rows, args.max_tokens, name)
        model_args = ["--model", model, "--served-model-name", name] if model else []
        submit_wall, submit_texts = run_submit(cmd, batch, tmp / "run", [*model_args, *engine])
        port = free_port()
        with open(tmp / "serve.log", "w") as log:
            server = start_server(cmd, tmp / "data", port, name, model, engine, log)
            try:
                serve_wall, serve_texts, lat = run_serve(
                    f"http://127.0.0.1:{port}/v1", batch, args.poll_s, args.probe_hz
                )
            finally:
                os.killpg(server.pid, signal.SIGTERM)
                server.wait(timeout=120)
    same = submit_texts == serve_texts and len(serve_texts) == args.rows
    lat_ms = sorted(x * 1000 for x in lat) or [float("nan")]
    p50, p99 = statistics.median(lat_ms), lat_ms[min(len(lat_ms) - 1, int(len(lat_ms) * 0.99))]
    what = "embedded SmolLM2" if args.embedded else f"{args.model} dummy"
    print(f"\n{args.rows} chat rows, max_tokens {args.max_tokens}, {what}, {args.device}, "
          f"--dp {args.dp}\n")  # fmt: skip
    print("| path | wall s | rows/s | vs submit |")
    print("|---|---:|---:|---:|")
    for label, wall in (("batchrun submit", submit_wall), ("batchrun serve", serve_wall)):
        print(f"| {label} | {wall:.1f} | {args.rows / wall:,.1f} | {wall / submit_wall:.3f}x |")
    print(f"\nGET /v1/batches/{{id}} while running: p50 {p50:.2f} ms, p99 {p99:.2f} ms "
          f"({len(lat)} requests); texts equal: {'yes' if same else 'NO'}")  # fmt: skip
    benchlib.OUT_DIR.mkdir(parents=True, exist_ok=True)
    result = {"rows": args.rows, "max_tokens": args.max_tokens, "model": what,
              "device": args.device, "dp": args.dp, "submit_s": submit_wall,
              "serve_s": serve_wall, "ratio": serve_wall / submit_wall, "get_p50_ms": p50,
              "get_p99_ms": p99, "gets": len(lat), "texts_equal": same,
              "commit": benchlib.git_commit()}  # fmt: skip
    (benchlib.OUT_DIR / "bench_serve.json").write_text(json.dumps(result, indent=2) + "\n")
    if not same:
        raise SystemExit("the server's texts differ from submit's")


if __name__ == "__main__":
    main()
