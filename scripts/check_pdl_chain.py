"""The kernel chain of tests/gpu/test_pdl.py (norm -> gemv -> SwiGLU -> gemv, 24 times, then the
argmax) in CUDA graphs and eagerly, with PDL on and off and gemv's split-K on and off: which
results differ, run to run and between modes (GPU only).

    python scripts/check_pdl_chain.py

On the H200 (ninth session, call 3, a fresh process) every comparison was equal. The test fails
when tests/gpu/test_kernels.py runs before it in the same process (docs/benchmarks.md): run this
after other GPU work in one process to chase that.
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import batchrun.kernels.gemv as G
from batchrun.kernels.activation import silu_and_mul
from batchrun.kernels.argmax import argmax
from batchrun.kernels.fused_norm import fused_add_rms_norm
from batchrun.kernels.pdl import PDL_ENV


def main() -> int:
    if not torch.cuda.is_available():
        print("check_pdl_chain: needs a CUDA GPU")
        return 0
    orig_pick = G.pick_config
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden, inter, layers = 2048, 4096, 24
    bf16 = torch.bfloat16
    ups = [
        torch.randn(2 * inter, hidden, device="cuda", generator=g).to(bf16) * 0.02 for _ in range(2)
    ]
    downs = [
        torch.randn(hidden, inter, device="cuda", generator=g).to(bf16) * 0.02 for _ in range(2)
    ]
    norm_w = torch.ones(hidden, device="cuda", dtype=bf16)
    head = torch.randn(32000, hidden, device="cuda", generator=g).to(bf16) * 0.02

    def chain(x, residual):
        for i in range(layers):
            h, residual = fused_add_rms_norm(x, residual, norm_w, 1e-5)
            x = G.gemv(silu_and_mul(G.gemv(h, ups[i % 2])), downs[i % 2])
        h, _ = fused_add_rms_norm(x, residual, norm_w, 1e-5)
        return argmax(G.gemv(h, head)), residual

    def run(pdl, split, graph_mode=True):
        os.environ.pop(PDL_ENV, None)
        if not pdl:
            os.environ[PDL_ENV] = "0"
        G.pick_config = (
            orig_pick if split else (lambda m, n, k: orig_pick(m, n, k)._replace(split_k=1))
        )
        x = torch.zeros(2, hidden, device="cuda", dtype=bf16)
        res = torch.zeros(2, hidden, device="cuda", dtype=bf16)
        x_in, res_in = x.clone(), res.clone()
        outs = []
        if graph_mode:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                chain(x.clone(), res.clone())
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    x.copy_(x_in)
                    res.copy_(res_in)
                    out = chain(x, res)
            torch.cuda.current_stream().wait_stream(stream)
        for step in range(20):
            gi = torch.Generator(device="cuda").manual_seed(100 + step)
            x_in.copy_(torch.randn(x_in.shape, device="cuda", generator=gi).to(bf16))
            res_in.copy_(torch.randn(res_in.shape, device="cuda", generator=gi).to(bf16))
            if graph_mode:
                graph.replay()
            else:
                out = chain(x_in.clone(), res_in.clone())
            outs.append((out[0].clone(), out[1].clone()))
        torch.cuda.synchronize()
        return outs

    def cmp(a, b):
        ids = sum(torch.equal(x[0], y[0]) for x, y in zip(a, b))
        res = sum(torch.equal(x[1], y[1]) for x, y in zip(a, b))
        diff = max((x[1].float() - y[1].float()).abs().max().item() for x, y in zip(a, b))
        return f"ids equal {ids}/20, res equal {res}/20, max |res diff| {diff:.3g}"

    for split in (True, False):
        r = {(pdl, rep): run(pdl, split) for pdl in (False, True) for rep in (0, 1)}
        e = {pdl: run(pdl, split, graph_mode=False) for pdl in (False, True)}
        print(f"split={split}")
        print("  off vs off  ", cmp(r[False, 0], r[False, 1]))
        print("  on vs on    ", cmp(r[True, 0], r[True, 1]))
        print("  off vs on   ", cmp(r[False, 0], r[True, 0]))
        print("  eager off vs graph off", cmp(e[False], r[False, 0]))
        print("  eager on vs eager off ", cmp(e[True], e[False]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
