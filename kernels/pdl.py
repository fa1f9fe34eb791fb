"""Programmatic dependent launch (PDL) for the decode kernels: Hopper and later GPUs may start a
kernel while the one before it on the stream is still draining.

At batch 1 a decode step is a chain of small kernels, several a layer, each short
(`scripts/profile_decode.py --model llama-1b --batch 1` lists them). Each boundary costs the
launch, the drain of the last wave and the first loads' latency, because nothing of kernel n + 1
runs before the last block of kernel n exits. With PDL (`launch_pdl=True`), kernel n + 1 is
launched once every block of kernel n has called `gdc_launch_dependents`; its blocks then do what
does not depend on kernel n (load their first weight tiles) and block in `gdc_wait` until kernel
n has finished and its writes are visible.

Every kernel of ours that is launched with PDL follows one rule, `pdl_wait` first (after the
weight-only prefetch, if any) and nothing written by an earlier kernel read before it; nothing
written at all before it. `pdl_wait` also calls `gdc_launch_dependents` right after the wait:
the next kernel may then start its prefetch while this one computes, but never two kernels ahead
(the next one's own trigger comes after its wait, that is after this kernel has finished). So a
kernel launched right after one of ours may read before its wait what was written before that
one was launched (kernels/moe_gemv.py's down kernel reads the router's expert ids, two kernels
back, to start its weight stream), never what the kernel just before it writes.

A kernel that is not ours (cuBLAS, torch's) never triggers early: the next PDL kernel then starts
when it completes, as without PDL, and a plain kernel after a PDL one waits for it in full. So PDL
and non-PDL kernels mix freely on one stream and in one CUDA graph.

    _kernel[grid](..., **pdl_launch_kwargs(pdl, x))    # the kernel's PDL constexpr and launch_pdl

Each wrapper takes `pdl` from the engine's KernelPlan (resolved at start-up: on for sm_90+
GPUs: batchrun/engine/kernel_choice.py); a CUDA graph keeps what it captured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def pdl_launch_kwargs(pdl: bool, x: torch.Tensor) -> dict:
    """A launch's kwargs on x's device: {"PDL": True, "launch_pdl": True} if pdl and x is on a
    GPU; {"PDL": False} otherwise (the CPU and Triton's interpreter included). The kernel's PDL
    constexpr (its pdl_wait) and the launch attribute come together, so neither is ever set
    without the other."""
    if not (pdl and x.is_cuda):
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the kernel before this one on the stream (all of its writes visible), then let
    the kernel after this one launch. A no-op unless PDL (a constexpr: pruned at compile time)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
