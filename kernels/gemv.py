"""Skinny matmul for decode: y[M, N] = x[M, K] @ w[N, K]^T for M <= 16 (F.linear without bias),
optionally with the SwiGLU gate as its epilogue (gate_up -> silu(gate) * up in one kernel).

At batch 1 a decode step is GEMVs, and cuBLAS reads a small model's weights far below the copy
ceiling (docs/benchmarks.md, Kernels: Decode GEMV): the small matrices of a 1b model (2048 x
2048, 2048 x 512) leave it few blocks in flight. This kernel streams w in [BLOCK_N, BLOCK_K]
tiles: a program owns BLOCK_N output columns and, with SPLIT_K > 1, one K-slice of them, so
small N still fills the GPU.

Split-K reduces inside the kernel, deterministically: each slice stores its fp32 partial sums to
its own plane of a [SPLIT_K, M, N] workspace, then bumps its column tile's counter; the slice
that finds the counter at SPLIT_K - 1 is the last to finish, and sums every plane in slice order
(so the result does not depend on which slice finished last: greedy tokens are the same from run
to run), writes y and resets the counter to 0 for the next call. No second kernel: a torch sum of
the planes would cost two more launches a matmul and break the PDL chain (kernels/pdl.py).

    y = gemv(x, w)                          # a config from pick_config(M, N, K)
    y = gemv(x, w, config=GemvConfig(...))  # scripts/bench_gemv.py sweeps these on the device
    a = gemv(x, w_gate_up, swiglu=True)     # silu(x @ w_gate.T) * (x @ w_up.T), [M, N / 2]
    h, normed = gemv_residual(x, w, residual, norm=(g, eps))  # x @ w.T + residual; rmsnorm(h) * g
    y = gemv_rms(h, rms_fold_weight(w, g), eps)  # rmsnorm(h) * g @ w.T, the norm in the matmul

gemv_residual adds the residual in the epilogue and, for one row, normalizes it in the column
tile that finishes last (a second counter, past the split counters, the same release / acquire):
a decoder layer's residual add and the RMSNorm after it cost no kernel of their own
(docs/benchmarks.md, Kernels: Decode GEMV).

With swiglu, w is [2I, K] (gate rows, then up rows, as the fused gate_up projection) and a
program owns BLOCK_N columns of both halves; gate and up are rounded to the activation dtype
before silu * up, as the [M, 2I] matmul output is, and the gate is computed as
kernels/activation.py computes it.

Accumulation is fp32 (tl.dot with x padded to 16 rows: the tensor cores do the padding rows for
free, and w is read once whatever M is). Grid (cdiv(N, BLOCK_N), SPLIT_K). The split counters
are one int32 buffer per device, zeroed once and left zeroed by every call: calls on one stream
never overlap past `pdl_wait`, where the counters are first touched. Run one call eagerly before
capturing a CUDA graph (it allocates them).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from batchrun.kernels.fused_norm import _normalize
from batchrun.kernels.pdl import pdl_launch_kwargs, pdl_wait

MAX_M = 16
# one counter per column tile of a split matmul: 128256 columns / 16 fits with room to spare
NUM_COUNTERS = 32768
# the index of gemv_residual's row counter (its in-kernel norm), past the split counters
ROW_COUNTER = tl.constexpr(NUM_COUNTERS)
SMEM_FOR_W = 160 << 10


class GemvConfig(NamedTuple):
    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _w_tile(w_rows, in_n, k0, k_end, BLOCK_K: tl.constexpr):
    """w [BLOCK_N, BLOCK_K] at K offset k0 (zeros past N and k_end)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_rows + offs_k[None, :], mask=in_n & (offs_k < k_end)[None, :], other=0.0)


@triton.jit
def _x_tile(X, offs_m, M, stride_xm, k0, k_end, BLOCK_K: tl.constexpr):
    """x [16, BLOCK_K] at K offset k0 (zeros past M and k_end: the tensor cores' padding)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_m[:, None] < M) & (offs_k < k_end)[None, :]
    return tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)


@triton.jit
def _mma(acc, x, w, IEEE: tl.constexpr):
    if IEEE:  # fp32 inputs: full precision, not tf32
        return tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


@triton.jit
def _swiglu(gate, up, dtype: tl.constexpr):
    """silu(gate) * up from fp32 sums, rounded as the unfused path rounds: gate and up to the
    dtype (the matmul's output), silu to the dtype, the product once."""
    gate = gate.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    return silu.to(tl.float32) * up.to(dtype).to(tl.float32)


@triton.jit
def _sum_planes(WS, plane_offs, mask, plane_stride, SPLIT_K: tl.constexpr):
    """The fp32 planes of every K slice at plane_offs, summed in slice order. `.cg` loads: from
    L2, where the other slices' stores are (this SM's L1 may hold stale lines of an earlier
    call's planes)."""
    total = tl.load(WS + plane_offs, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT_K):
        plane = WS + s * plane_stride + plane_offs
        total += tl.load(plane, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _write_y(acc, acc_up, out, mask, res, dtype: tl.constexpr, SWIGLU: tl.constexpr,
             ADD_RES: tl.constexpr):  # fmt: skip
    """y from the fp32 sums: the SwiGLU gate, or the residual added, rounded as torch's
    `linear(x, w) + residual` of the dtype rounds."""
    if SWIGLU:
        y = _swiglu(acc, acc_up, dtype).to(dtype)
    else:
        y = acc.to(dtype)
    if ADD_RES:
        y = (y.to(tl.float32) + res.to(tl.float32)).to(dtype)
    tl.store(out, y, mask=mask)


@triton.jit
def _norm_after_last_tile(Y, G, NormOut, RowCounter, N, eps, num_tiles, BLOCK_ROW: tl.constexpr):
    """Once every column tile has written its part of the row y (M = 1): the tile that finished
    last normalizes the whole row for the next matmul, as kernels/fused_norm.py does (the same
    `_normalize`), and resets the row counter. Each tile's writer calls this after its store."""
    # NOTE: the same release / acquire as split-K's: every thread's stores, a CTA barrier, one
    # gpu-scope acq_rel atomic; the last tile then reads the others' parts from L2 (`.cg`)
    tl.debug_barrier()
    done = tl.atomic_add(RowCounter, 1, sem="acq_rel", scope="gpu")
    if done == num_tiles - 1:
        offs = tl.arange(0, BLOCK_ROW)
        mask = offs < N
        s = tl.load(Y + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        normed = _normalize(s, G, offs, mask, N, eps, NormOut.dtype.element_ty)
        tl.store(NormOut + offs, normed, mask=mask)
        tl.atomic_xchg(RowCounter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _gemv_kernel(
    X,
    W,
    Y,
    WS,
    Counters,
    R,
    G,
    NormOut,
    M,
    N,
    K,
    k_per_split,
    up_offset,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_rm,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SWIGLU: tl.constexpr,
    ADD_RES: tl.constexpr,
    NORM_OUT: tl.constexpr,
    NORM_IN: tl.constexpr,  # x is the raw residual row, w the weight times the norm's: rstd last
    BLOCK_ROW: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    up_rows = w_rows + up_offset  # SWIGLU: the up half's rows, N below
    in_n = offs_n[:, None] < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    # NOTE: the first two tiles are peeled off the loop so that their w loads come before the
    # PDL wait: weights are no earlier kernel's output, so with PDL those loads overlap the
    # kernel before (kernels/pdl.py); x is read after the wait. Two tiles, not one: W3 reads
    # faster (docs/benchmarks.md, Kernels: Decode GEMV)
    w = _w_tile(w_rows, in_n, k_start, k_end, BLOCK_K)
    if SWIGLU:
        w_up = _w_tile(up_rows, in_n, k_start, k_end, BLOCK_K)
    w2 = _w_tile(w_rows, in_n, k_start + BLOCK_K, k_end, BLOCK_K)  # zeros past k_end
    if SWIGLU:
        w2_up = _w_tile(up_rows, in_n, k_start + BLOCK_K, k_end, BLOCK_K)
    pdl_wait(PDL)
    res = tl.zeros([16, BLOCK_N], dtype=Y.dtype.element_ty)
    if ADD_RES:  # read by every slice now, where its latency hides behind the loop
        res = tl.load(R + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0)
    if NORM_IN:  # the whole row (every K slice's too), summed after the loop: latency hidden
        offs_row = tl.arange(0, BLOCK_ROW)
        row = tl.load(X + offs_row, mask=offs_row < K, other=0.0).to(tl.float32)
    x = _x_tile(X, offs_m, M, stride_xm, k_start, k_end, BLOCK_K)
    acc = _mma(tl.zeros([16, BLOCK_N], dtype=tl.float32), x, w, IEEE)
    acc_up = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    if SWIGLU:
        acc_up = _mma(acc_up, x, w_up, IEEE)
    x = _x_tile(X, offs_m, M, stride_xm, k_start + BLOCK_K, k_end, BLOCK_K)
    acc = _mma(acc, x, w2, IEEE)
    if SWIGLU:
        acc_up = _mma(acc_up, x, w2_up, IEEE)
    for k0 in range(k_start + 2 * BLOCK_K, k_end, BLOCK_K):
        x = _x_tile(X, offs_m, M, stride_xm, k0, k_end, BLOCK_K)
        acc = _mma(acc, x, _w_tile(w_rows, in_n, k0, k_end, BLOCK_K), IEEE)
        if SWIGLU:
            acc_up = _mma(acc_up, x, _w_tile(up_rows, in_n, k0, k_end, BLOCK_K), IEEE)
    if NORM_IN:  # rmsnorm(x) * g @ w.T = rstd * (x @ (w * g).T): the norm's scale, last (a K
        rstd = tl.math.rsqrt(tl.sum(row * row, 0) / K + eps)  # slice scales its partial sums)
        acc = acc * rstd
        if SWIGLU:
            acc_up = acc_up * rstd
    out = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    dtype = Y.dtype.element_ty
    row_counter = Counters + ROW_COUNTER
    if SPLIT_K == 1:
        _write_y(acc, acc_up, out, mask, res, dtype, SWIGLU, ADD_RES)
        if NORM_OUT:
            _norm_after_last_tile(Y, G, NormOut, row_counter, N, eps, tl.num_programs(0), BLOCK_ROW)
    else:
        # planes [SPLIT_K, M, WS_N]: WS_N = N, or 2N with the up sums in the second half
        ws_n = 2 * N if SWIGLU else N
        plane_stride = M * ws_n
        plane_offs = offs_m[:, None] * ws_n + offs_n[None, :]
        tl.store(WS + pid_k * plane_stride + plane_offs, acc, mask=mask)
        if SWIGLU:
            tl.store(WS + pid_k * plane_stride + plane_offs + N, acc_up, mask=mask)
        # NOTE: every thread's stores are issued before the one thread's release (bar.sync, then
        # a gpu-scope acq_rel atomic): the last slice's acquire then sees all of them
        tl.debug_barrier()
        counter = Counters + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = _sum_planes(WS, plane_offs, mask, plane_stride, SPLIT_K)
            total_up = total
            if SWIGLU:
                total_up = _sum_planes(WS, plane_offs + N, mask, plane_stride, SPLIT_K)
            _write_y(total, total_up, out, mask, res, dtype, SWIGLU, ADD_RES)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next call
            if NORM_OUT:
                _norm_after_last_tile(
                    Y, G, NormOut, row_counter, N, eps, tl.num_programs(0), BLOCK_ROW
                )


class SplitRule(NamedTuple):
    """How a decode kernel splits K (`split_k_for`): slices double while the programs stay
    within target_programs, up to max_split slices of at least min_tiles K tiles each; with
    max_tiles, only matrices of at most that many column tiles split."""

    target_programs: int
    max_split: int
    min_tiles: int = 1
    max_tiles: int | None = None


def split_k_for(tiles: int, k: int, block_k: int, rule: SplitRule) -> int:
    """The K slices (a power of two) of a product of `tiles` column tiles (programs) and
    depth k in block_k tiles: the one split-K rule of the decode kernels, each with its own
    SplitRule."""
    split = 1
    if rule.max_tiles is not None and tiles > rule.max_tiles:
        return split
    while (
        split < rule.max_split
        and tiles * split * 2 <= rule.target_programs
        and k >= 2 * rule.min_tiles * split * block_k
    ):
        split *= 2
    return split


# NOTE: K-split programs aimed at: about two per SM of the H200 (132 SMs); only matrices of at
# most 128 column tiles split (gate_up, lm_head are not). llama-8b's qkv (96 tiles) splits in 2:
# alone it reads fastest unsplit, but in the decode chain its 96 programs, one an SM, keep too
# few bytes in flight (docs/benchmarks.md, Kernels: Decode GEMV)
SPLIT = SplitRule(target_programs=256, max_split=8, min_tiles=1, max_tiles=128)


def pick_config(m: int, n: int, k: int) -> GemvConfig:
    """The sweep's best configs on the H200 (M = 1, the matrices of llama-1b and llama-8b), as a
    rule: 64 columns x 256-wide K tiles a program, split along K by SPLIT
    (docs/benchmarks.md, Kernels: Decode GEMV)."""
    block_n, block_k = 64, 256
    split_k = split_k_for(triton.cdiv(n, block_n), k, block_k, SPLIT)
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split_k)


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    # NOTE: allocated outside any CUDA graph capture (a graph would own it and its memset)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    assert not capturing, "run gemv once eagerly before capturing a CUDA graph"
    return torch.zeros(NUM_COUNTERS + 1, dtype=torch.int32, device=device)


def split_counters(device: torch.device) -> torch.Tensor:
    """The device's split-K counters (allocated, zeroed, on first use)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _counters(device)


class ResidualStream(NamedTuple):
    """gemv_residual's output: h = x @ w.T + residual [M, N] (the new residual stream) and, when
    asked for, normed = rmsnorm(h) * weight (the next matmul's input), else None."""

    h: torch.Tensor
    normed: torch.Tensor | None


def gemv(
    x: torch.Tensor,  # [M, K], M <= 16, unit stride along K
    w: torch.Tensor,  # [N, K], unit stride along K (an nn.Linear weight); swiglu: [2I, K]
    config: GemvConfig | None = None,
    swiglu: bool = False,
    *,
    pdl: bool = False,  # launched with programmatic dependent launch (kernels/pdl.py)
) -> torch.Tensor:
    """x @ w.T: [M, N] in x's dtype; with swiglu, silu(x @ w_gate.T) * (x @ w_up.T): [M, I]."""
    return _launch(x, w, config, swiglu, None, None, pdl=pdl)[0]


def gemv_rms(
    h: torch.Tensor,  # [1, K], the residual stream (unnormalized), unit stride
    w_normed: torch.Tensor,  # [N, K]: w * g[None, :] (rms_fold_weight), h's dtype
    eps: float,
    config: GemvConfig | None = None,
    swiglu: bool = False,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """rmsnorm(h) * g @ w.T for one row, as rstd * (h @ (w * g).T): the RMSNorm before a matmul
    inside it (with swiglu, before gate_up: silu(gate) * up of those sums, [1, N / 2]). Each
    program also loads the whole row (8 KB on llama-8b, from L2) after its wait, sums its
    squares after the loop, and the scale rstd multiplies its fp32 sums (a K slice's partial
    sums) at the end: no kernel, no store and no reload of the normalized row between the
    matmul before and this one. Rounding differs from the norm kernel then gemv: w * g is
    rounded to the dtype (a relative 2^-9 or so a term) where the norm kernel rounds h * rstd
    and then its product with g, and rstd scales the fp32 sums, not each term."""
    assert h.shape[0] == 1 and w_normed.dtype == h.dtype
    return _launch(h, w_normed, config, swiglu, None, None, eps, pdl=pdl)[0]


def rms_fold_weight(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """w * g[None, :] in w's dtype (computed in fp32): gemv_rms's weight for the RMSNorm of
    weight g before the matmul of w."""
    assert w.shape[1] == g.shape[0]
    return (w.float() * g.float()[None, :]).to(w.dtype)


def gemv_residual(
    x: torch.Tensor,  # [M, K], as gemv's
    w: torch.Tensor,  # [N, K]
    residual: torch.Tensor,  # [M, N], x's dtype, unit stride along N; not written
    norm: tuple[torch.Tensor, float] | None = None,  # (weight [N], eps); only for M = 1
    config: GemvConfig | None = None,
    *,
    pdl: bool = False,
) -> ResidualStream:
    """h = x @ w.T + residual, rounded as torch's `linear(x, w) + residual`; with norm, also
    rmsnorm(h) * weight computed inside the kernel by the column tile that finishes last (the
    numerics of kernels/fused_norm.py), for a single row: the residual add and the norm that
    sit between two decode matmuls without a kernel of their own."""
    check_residual(x, w.shape[0], residual, norm)
    return ResidualStream(*_launch(x, w, config, False, residual, norm, pdl=pdl))


def check_residual(x: torch.Tensor, n: int, residual: torch.Tensor, norm) -> None:
    """A residual epilogue's operands: residual [M, N] in x's dtype with unit stride along N;
    the in-kernel norm's (weight [N] contiguous, eps) for one row only."""
    m = x.shape[0]
    assert residual.shape == (m, n) and residual.dtype == x.dtype and residual.stride(1) == 1
    if norm is not None:
        weight, _ = norm
        assert m == 1, "the in-kernel norm takes one row (decode batch 1)"
        assert weight.shape == (n,) and weight.dtype == x.dtype and weight.is_contiguous()


def _launch(
    x, w, config, swiglu, residual, norm, norm_in_eps: float | None = None, *, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y, normed): normed when norm is given, else None. norm_in_eps: gemv_rms."""
    m, k = x.shape
    n_rows, k_w = w.shape
    assert k == k_w and m <= MAX_M and x.stride(1) == 1 and w.stride(1) == 1
    assert x.dtype == w.dtype
    assert not swiglu or n_rows % 2 == 0
    n = n_rows // 2 if swiglu else n_rows
    # NOTE: with swiglu each program reads a tile of each half: the config of the whole matmul,
    # half the columns per program
    cfg = config or pick_config(m, n_rows, k)
    if swiglu and config is None:
        cfg = cfg._replace(block_n=max(16, cfg.block_n // 2))
    if x.dtype == torch.float32:  # 4-byte tiles: fit the shared memory (227 KB on the H200)
        cfg = cfg._replace(block_k=min(cfg.block_k, 128), num_stages=min(cfg.num_stages, 2))
    # the w tiles in flight (two a stage with swiglu) within the shared memory, x's tiles aside
    tile_bytes = (2 if swiglu else 1) * cfg.block_n * cfg.block_k * x.element_size()
    while cfg.num_stages > 1 and tile_bytes * cfg.num_stages > SMEM_FOR_W:
        cfg = cfg._replace(num_stages=cfg.num_stages - 1)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(k, k_per_split)
    tiles = triton.cdiv(n, cfg.block_n)
    if tiles > NUM_COUNTERS:
        split_k, k_per_split = 1, k
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    normed = None if norm is None else torch.empty_like(y)
    if m == 0 or n == 0:
        return y, normed
    counters = split_counters(x.device)
    # fp32 planes of the K slices' partial sums (without split-K the kernel never reads them)
    ws = (
        y
        if split_k == 1
        else torch.empty(split_k * m * n_rows, dtype=torch.float32, device=x.device)
    )
    # NOTE: absent operands get y as a stand-in pointer: their constexpr flag prunes every access
    r = y if residual is None else residual
    norm_w, eps = (y, 0.0) if norm is None else norm
    # the row a program reduces whole: x's (NORM_IN) or y's (NORM_OUT)
    row_len = k if norm_in_eps is not None else n if norm is not None else 1
    if norm_in_eps is not None:
        eps = norm_in_eps
    launch = pdl_launch_kwargs(pdl, x)
    _gemv_kernel[(tiles, split_k)](
        x, w, y, ws, counters, r, norm_w, y if normed is None else normed, m, n, k, k_per_split,
        n * w.stride(0), x.stride(0), w.stride(0), y.stride(0), r.stride(0), eps,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split_k, SWIGLU=swiglu,
        ADD_RES=residual is not None, NORM_OUT=norm is not None,
        NORM_IN=norm_in_eps is not None, BLOCK_ROW=triton.next_power_of_2(row_len),
        IEEE=x.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch,
    )  # fmt: skip
    return y, normed
