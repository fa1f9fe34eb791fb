"""Does a step gain from running its decode rows on a second stream, beside its other rows?

A W1 llama-8b step is matmuls (compute-bound, ~69 % of the run, at the H200's 700 W cap) and
the decode attention (memory-bound, ~24 %, at the copy ceiling) one after the other. Split into
two sub-batches on two streams, one sub-batch's attention could run while the other's matmuls
do (the idea of NanoFlow's nano-batches). This times whole forwards (every layer on its own
weights, the decode attention on ragged contexts scattered over a pool, as bench_attention_kernels
--decode-run) for `--seconds` each, so the power cap holds as in a run:

    serial P+D     one stream: matmuls of P + D rows, the D rows' attention      (a mixed step)
    split P | D    stream 1: matmuls of P rows; stream 2: D rows' matmuls + attention
    serial D       one stream: matmuls of D rows, their attention                (a decode step)
    split D/2|D/2  two streams, each half the decode rows with its own attention

Stream 2 runs at high priority where marked (its blocks go first when an SM frees). The extend
attention, norms and SiLU are left out: they are the same in both orders.

    python scripts/bench_stream_overlap.py --prefill-rows 8192 --decode-rows 1008 --seconds 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "scripts"))

from batchrun.kernels.decode_attention import (  # noqa: E402
    decode_attention_fwd,
    decode_counters,
    decode_workspace_numel,
)
from bench_attention_kernels import DEV, DTYPE, KV, D, H, decode_run_kv  # noqa: E402

from batchrun.attention.triton_backend import TritonAttentionBackend  # noqa: E402

HIDDEN, INTER = 4096, 14336  # llama-8b's (H, KV, D: bench_attention_kernels's, llama-8b's too)
QKV = (H + 2 * KV) * D


class Decode:
    """The decode attention of `batch` rows over ragged contexts (uniform in mean_len +- 128),
    slots scattered over a pool, on `kv_layers` layers of KV (cycled: each layer's KV is far
    larger than the L2)."""

    def __init__(self, batch: int, mean_len: int, kv_layers: int, seed: int):
        self.kv_layers = kv_layers
        lens, self.pool, self.table = decode_run_kv(batch, mean_len, 0, kv_layers, seed=seed)
        self.seq_lens = lens.to(DEV)
        self.rows = torch.arange(batch, device=DEV)
        self.q = torch.randn(batch, H, D, device=DEV, dtype=DTYPE)
        self.out = torch.empty_like(self.q)
        self.splits = TritonAttentionBackend(self.pool, self.table)._num_kv_splits(batch)
        self.workspace = torch.empty(decode_workspace_numel(batch, H, D, self.splits), device=DEV)
        self.counters = decode_counters(batch, KV, DEV)

    def __call__(self, layer: int) -> None:
        decode_attention_fwd(
            self.q, *self.pool.buffers(layer % self.kv_layers), self.out, self.table, self.rows,
            self.seq_lens, D**-0.5, self.splits, self.workspace, self.counters,
        )  # fmt: skip


class Rows:
    """A sub-batch's buffers: rows through every layer's qkv, o, gate_up, SiLU and down."""

    def __init__(self, rows: int, attend: Decode | None):
        def empty(n):
            return torch.empty(rows, n, device=DEV, dtype=DTYPE)

        self.x = torch.randn(rows, HIDDEN, device=DEV, dtype=DTYPE)
        self.qkv, self.o = empty(QKV), empty(HIDDEN)
        self.gu, self.act = empty(2 * INTER), empty(INTER)
        self.attn_in = empty(HIDDEN)  # the o projection's input (the attention's output rows)
        self.attend = attend

    def layer(self, i: int, w: dict) -> None:
        torch.matmul(self.x, w["qkv"].t(), out=self.qkv)
        if self.attend is not None:
            self.attend(i)
        torch.matmul(self.attn_in, w["o"].t(), out=self.o)
        torch.matmul(self.o, w["gate_up"].t(), out=self.gu)
        torch.mul(F.silu(self.gu[:, :INTER]), self.gu[:, INTER:], out=self.act)
        torch.matmul(self.act, w["down"].t(), out=self.x)


def weights(layers: int) -> list[dict]:
    def w(n, k):
        return torch.randn(n, k, device=DEV, dtype=DTYPE) * 0.02

    return [
        {"qkv": w(QKV, HIDDEN), "o": w(HIDDEN, H * D), "gate_up": w(2 * INTER, HIDDEN),
         "down": w(HIDDEN, INTER)}
        for _ in range(layers)
    ]  # fmt: skip


def forward(parts: list[tuple[Rows, torch.cuda.Stream]], ws: list[dict]) -> None:
    """Every part's layers on its stream; the current stream waits for all of them."""
    main = torch.cuda.current_stream()
    for _, stream in parts:
        stream.wait_stream(main)
    for i, w in enumerate(ws):  # layer by layer, alternating streams: both stay fed
        for rows, stream in parts:
            with torch.cuda.stream(stream):
                rows.layer(i, w)
    for _, stream in parts:
        main.wait_stream(stream)


def timed(parts, ws, seconds: float) -> tuple[float, float]:
    """(mean, p50) ms per forward, over `seconds` after one untimed forward."""
    forward(parts, ws)
    torch.cuda.synchronize()
    events = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or len(events) < 3:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        forward(parts, ws)
        end.record()
        events.append((start, end))
        if len(events) % 8 == 0:
            events[-8][1].synchronize()  # keep the host at most a few forwards ahead
    torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in events]
    return statistics.mean(ms), statistics.median(ms)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill-rows", type=int, default=8192)
    p.add_argument("--decode-rows", type=int, default=1008)
    p.add_argument("--context", type=int, default=640, help="decode rows' mean KV length")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-layers", type=int, default=4)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    P, B = args.prefill_rows, args.decode_rows
    ws = weights(args.layers)
    full = Decode(B, args.context, args.kv_layers, seed=0)
    halves = [Decode(B // 2, args.context, args.kv_layers, seed=s) for s in (1, 2)]
    main_s = torch.cuda.current_stream()
    s1 = torch.cuda.Stream()
    lo, hi = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)
    variants = {
        f"serial P+D ({P}+{B})": [(Rows(P + B, full), main_s)],
        "split P | D, D high priority": [(Rows(P, None), s1), (Rows(B, full), hi)],
        "split P | D, same priority": [(Rows(P, None), s1), (Rows(B, full), lo)],
        f"serial D ({B})": [(Rows(B, full), main_s)],
        "split D/2 | D/2": [(Rows(B // 2, halves[0]), s1), (Rows(B // 2, halves[1]), lo)],
        "split D/2 | D/2, one high priority": [
            (Rows(B // 2, halves[0]), s1),
            (Rows(B // 2, halves[1]), hi),
        ],
    }
    results: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, parts in variants.items():
            mean, p50 = timed(parts, ws, args.seconds)
            results[name].append(mean)
            print(f"round {r} {name:40s} {mean:8.2f} ms (p50 {p50:.2f})", flush=True)
    print("\nbest of rounds, ms per forward:")
    for name, ms in results.items():
        print(f"  {name:40s} {min(ms):8.2f}")


if __name__ == "__main__":
    main()
