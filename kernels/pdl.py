"""Programmatic dependent launch (PDL) for the decode kernels: Hopper and later GPUs may start a
kernel while the one before it on the stream is still draining.

At batch 1 a decode step is a chain of ~11 small kernels a layer (llama-1b: 209 a step, 1,096 µs
of kernels in a 1,237 µs step on the H200, fifth session). Each boundary costs the launch, the
drain of the last wave and the first loads' latency, because nothing of kernel n + 1 runs before
the last block of kernel n exits. With PDL (`launch_pdl=True`), kernel n + 1 is launched once
every block of kernel n has called `gdc_launch_dependents`; its blocks then do what does not
depend on kernel n (load their first weight tiles) and block in `gdc_wait` until kernel n has
finished and its writes are visible.

Every kernel of ours that is launched with PDL follows one rule, `pdl_wait` first (after the
weight-only prefetch, if any) and nothing written by an earlier kernel read before it; nothing
written at all before it. `pdl_wait` also calls `gdc_launch_dependents` right after the wait:
the next kernel may then start its prefetch while this one computes, but never two kernels ahead
(the next one's own trigger comes after its wait, that is after this kernel has finished).

A kernel that is not ours (cuBLAS, torch's) never triggers early: the next PDL kernel then starts
when it completes, as without PDL, and a plain kernel after a PDL one waits for it in full. So PDL
and non-PDL kernels mix freely on one stream and in one CUDA graph.

    _kernel[grid](..., **pdl_launch_kwargs(x))    # the kernel's PDL constexpr and launch_pdl

`BATCHRUN_PDL=0` turns it off (read on every launch, so tests can flip it; a CUDA graph keeps
what it captured).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

PDL_ENV = "BATCHRUN_PDL"


@functools.cache
def _supports_pdl(index: int) -> bool:
    # NOTE: sm_90 (Hopper) and later; older GPUs reject the launch attribute
    return torch.cuda.get_device_capability(index)[0] >= 9


def device_supports_pdl(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return _supports_pdl(torch.cuda.current_device() if device.index is None else device.index)


def pdl_launch_kwargs(x: torch.Tensor) -> dict:
    """A launch's kwargs on x's device: {"PDL": True, "launch_pdl": True} if the GPU supports
    PDL and BATCHRUN_PDL is not "0"; {"PDL": False} otherwise (the CPU and Triton's interpreter
    included). The kernel's PDL constexpr (its pdl_wait) and the launch attribute come together,
    so neither is ever set without the other."""
    if not x.is_cuda or os.environ.get(PDL_ENV) == "0" or not device_supports_pdl(x.device):
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the kernel before this one on the stream (all of its writes visible), then let
    the kernel after this one launch. A no-op unless PDL (a constexpr: pruned at compile time)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
