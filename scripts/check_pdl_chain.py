"""The kernel chain of tests/gpu/test_pdl.py (norm -> gemv -> SwiGLU -> gemv, 24 times, then the
argmax) in CUDA graphs and eagerly, with PDL on and off and gemv's split-K on and off: which
results differ, run to run and between modes (GPU only).

    python scripts/check_pdl_chain.py

Written to chase the test's failure after other GPU tests in one process (ninth session). The
cause was the harness, not PDL (twelfth session): capture_chain dropped the graph's own x buffer,
whose memory the allocator then gave to the replay loop's clones, and later replays overwrote
them. capture_chain now hands the buffers back to be kept with the graph.
"""

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
import batchrun.kernels.gemv as G  # noqa: E402
from batchrun.kernels.pdl import PDL_ENV  # noqa: E402


def main() -> int:
    if not torch.cuda.is_available():
        print("check_pdl_chain: needs a CUDA GPU")
        return 0
    from test_pdl import CHAIN_HIDDEN, capture_chain, feed_chain_inputs, make_decode_chain

    orig_pick = G.pick_config
    chain = make_decode_chain()

    def run(pdl, split, graph_mode=True):
        os.environ.pop(PDL_ENV, None)
        if not pdl:
            os.environ[PDL_ENV] = "0"
        G.pick_config = (
            orig_pick if split else (lambda m, n, k: orig_pick(m, n, k)._replace(split_k=1))
        )
        if graph_mode:
            graph, x_in, res_in, out, _buffers = capture_chain(chain)  # live with the graph
        else:
            x_in = torch.zeros(2, CHAIN_HIDDEN, device="cuda", dtype=torch.bfloat16)
            res_in = torch.zeros_like(x_in)
        outs = []
        for step in range(20):
            feed_chain_inputs(x_in, res_in, step)
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
