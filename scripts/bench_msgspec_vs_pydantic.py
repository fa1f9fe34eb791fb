"""Encode the same result record N times with msgspec (batchrun's ResultRecord, defaults omitted)
and with pydantic v2 ``model_dump_json`` of an equivalent model; print the times and the ratio.

    python scripts/bench_msgspec_vs_pydantic.py [--n 100000] [--token-ids]

pydantic is a test extra only (pip install -e ".[test]"); batchrun itself does not import it.
"""

from __future__ import annotations

import argparse
import json
import time

import msgspec
from pydantic import BaseModel

from batchrun.io.records import ResultRecord, Usage
from batchrun.progress.snapshot import Snapshot


class PUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class PResultRecord(BaseModel):
    id: str
    text: str
    finish_reason: str
    usage: PUsage
    index: int | None = None
    token_ids: list[int] | None = None
    logprobs: list | None = None
    row: int | None = None
    latency_s: float | None = None
    ttft_s: float | None = None


class PSnapshot(BaseModel):
    status: str = "running"
    rows_done: int = 0
    rows_total: int | None = None
    rows_ok: int = 0
    rows_failed: int = 0
    resumed_rows: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    output_tok_s: float = 0.0
    recent_tok_s: float = 0.0
    cached_fraction: float = 0.0
    elapsed_s: float = 0.0
    eta_s: float | None = None
    clients: int = 0


def best_of(fn, n: int, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--token-ids", action="store_true", help="include 64 token ids")
    args = ap.parse_args(argv)
    fields = dict(
        id="chat-concise",
        text="The Earth's seasons are caused by the tilt of its axis and elliptical orbit "
        "around the Sun.",
        finish_reason="stop",
        token_ids=list(range(1000, 1064)) if args.token_ids else None,
        row=25,
    )
    usage = dict(prompt_tokens=28, completion_tokens=22, cached_tokens=0)
    m_rec = ResultRecord(usage=Usage(**usage), **fields)
    p_rec = PResultRecord(usage=PUsage(**usage), **fields)
    encoder = msgspec.json.Encoder()
    m_out = encoder.encode(m_rec)
    p_out = p_rec.model_dump_json(exclude_defaults=True).encode()
    assert json.loads(m_out) == json.loads(p_out), (m_out, p_out)

    snap = dict(rows_done=1200, rows_total=5000, rows_ok=1199, rows_failed=1, prompt_tokens=9690)
    snap |= dict(cached_tokens=3981, output_tokens=76800, output_tok_s=15179.2, elapsed_s=5.06)
    m_snap, p_snap = Snapshot(**snap), PSnapshot(**snap)
    assert json.loads(encoder.encode(m_snap)) == json.loads(
        p_snap.model_dump_json(exclude_defaults=True)
    )

    print(
        f"{args.n:,} encodes each, best of 3 (msgspec {msgspec.__version__}, pydantic "
        f"{__import__('pydantic').VERSION}); result record {len(m_out)} bytes"
    )
    for name, m_fn, p_fn in [
        (
            "result record",
            lambda: encoder.encode(m_rec),
            lambda: p_rec.model_dump_json(exclude_defaults=True),
        ),
        (
            "snapshot",
            lambda: encoder.encode(m_snap),
            lambda: p_snap.model_dump_json(exclude_defaults=True),
        ),
    ]:
        m_t, p_t = best_of(m_fn, args.n), best_of(p_fn, args.n)
        print(
            f"{name:14} msgspec {m_t * 1e9 / args.n:7.0f} ns/record  "
            f"pydantic {p_t * 1e9 / args.n:7.0f} ns/record  ratio {p_t / m_t:.1f}x"
        )


if __name__ == "__main__":
    main()
