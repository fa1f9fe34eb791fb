"""The experts of a mixture-of-experts layer on the GPU: two grouped GEMMs over the tokens sorted
by expert (kernels/moe_align.py), with no host sync, so a step runs inside a CUDA graph.

    y[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, j]

    x             [T, H]        bf16 / fp16 (fp32 runs on the GPU's TF32 tensor cores)
    w13           [E, 2I, H]    each expert's gate rows, then its up rows
    w2            [E, H, I]
    topk_weights  [T, k]        float32, as the router renormalized them
    topk_ids      [T, k]        int32 / int64

    align      rows r = t * k + j grouped by expert, padded to blocks of BLOCK_M
    gate_up    block b of expert e: x[r // k] @ w13[e]^T, gate and up in two accumulators;
               the epilogue writes silu(gate) * up (fp32, rounded once) to inter[r]   [T * k, I]
    down       inter[r] @ w2[e]^T times topk_weights[r] (fp32, before the rounding) to out[r]
    sum        y = out.view(T, k, H).sum(1)                                          [T, H]

gpt-oss (`extras=`): gate_up's epilogue adds the expert's bias b13[e] ([E, 2I], gate then up)
and applies its clamped SwiGLU, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
g = min(gate, limit); down's adds b2[e] ([E, H]) before the top-k weight (b2 None: no bias).
Gemma 4 (`extras.act` "gelu_pytorch_tanh"): the epilogue's gate is GELU with the tanh
approximation, gelu_tanh(g) * up, computed as g * sigmoid(2 sqrt(2 / pi) (g + 0.044715 g^3))
(0.5 (1 + tanh(z)) = sigmoid(2 z)).

The top-k sum reads a [T * k, H] buffer rather than adding into y with atomics: the sum is
deterministic (graphs and eager, overlap on and off, give the same bits, which greedy parity
tests rely on), needs no zeroed fp32 buffer and no cast after it, and costs one read and write
of T * k * H elements, small beside the down GEMM's T * k * H * I products. The buffers are
bounded by running at most MAX_CHUNK_ROWS routed rows (T * k) at a time.

Tiles come from a rule on (T, E, k, H, I) (`pick_config`), no autotuning (it costs start-up and
cannot run inside graph capture). What decides is the rows each expert gets in a pass,
T * k / E, with T a pass's tokens rounded up as `tile_tokens` says (so that a step padded to a
graph's size picks the tiles its eager run picks):

    <= 16       decode: 16-row blocks, one weight tile read once per touched expert; column
                tiles of 32 where 64 would give fewer than ~2 programs per SM (132 SMs)
    <= 32       32-row blocks
    <= 128      64-row blocks, 64 x 64 (gate_up, two accumulators) / 64 x 128 (down) tiles
    <= 256      64-row blocks, 64 x 128 tiles in both
    larger      prefill: 128-row blocks, 8 warps

The 64-row tiles are the sweep's best on the H200 at Qwen3-30B-A3B's widths (E 128, top 8,
H 2048, I 768), at 64 and at 256 rows an expert (docs/benchmarks.md, Other architectures: MoE,
with the decode tiles' rate).
`scripts/check_kernels_compile.py` compiles the tiles the rule picks at the real models' shapes
for sm_90 under Triton 3.6 (no spills).

MoeConfig gather=True runs the same GEMMs on x's routed rows gathered into the aligned order
first, both operands read through TMA descriptors (kernels/fused_moe_tma.py; the PTX has TMA
loads and wgmma where these kernels have cp.async). The rule picks it past 32 rows an expert
(the 64- and 128-row blocks), where it is faster at every size measured on Qwen3-30B-A3B's and
Mixtral's widths (docs/benchmarks.md, Other architectures: MoE).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from batchrun.kernels.moe_align import align_by_expert, max_blocks

MAX_CHUNK_ROWS = 32768  # routed rows (T * k) per pass: bounds inter and out (H=4096: 256 MiB)
MIN_PROGRAMS = 264  # about two programs per SM of the H200's 132
TILE_STEP = 256  # engine/piecewise_graph.py's BUCKET: see tile_tokens


class GemmTiles(NamedTuple):
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


class MoeConfig(NamedTuple):
    block_m: int  # the alignment's block, shared by both GEMMs
    gate_up: GemmTiles
    down: GemmTiles
    # the routed rows of x gathered into the aligned order first, so that both GEMMs read their
    # operands through TMA descriptors (kernels/fused_moe_tma.py); False: gathered row by row
    gather: bool = False


def tokens_per_pass(top_k: int, max_rows: int | None = None) -> int:
    """The tokens one pass of fused_moe runs: MAX_CHUNK_ROWS routed rows (or max_rows where
    fewer), rounded down to a multiple of TILE_STEP so that a step's last pass pads like the step
    (`tile_tokens`)."""
    rows = MAX_CHUNK_ROWS if max_rows is None else min(MAX_CHUNK_ROWS, max_rows)
    return max(TILE_STEP, rows // top_k // TILE_STEP * TILE_STEP)


def tile_tokens(num_tokens: int) -> int:
    """The token count a pass's tiles are picked for: the next power of two up to TILE_STEP, the
    next multiple of TILE_STEP above it. The CUDA graphs pad a step to a captured size that never
    leaves this bucket (engine/cuda_graph.py's decode sizes hold every power of two to 256 and
    then multiples of 32; engine/piecewise_graph.py's, for a mixture of experts, the powers of two
    below its bucket and then multiples of it), so a step picks the same tiles eager and padded:
    a row's sums do not depend on which other rows share its tiles, but do on the tiles' shape
    (BLOCK_K, and mma.sync against wgmma at small BLOCK_M), and the greedy parity of graphs and
    eager rests on that."""
    if num_tokens <= TILE_STEP:
        return triton.next_power_of_2(max(num_tokens, 1))
    return triton.cdiv(num_tokens, TILE_STEP) * TILE_STEP


def pick_config(
    num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int
) -> MoeConfig:
    """The tiles for T = num_tokens routed to top_k of num_experts experts of widths H, I."""
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 16:
        touched = min(num_experts, num_tokens * top_k)
        gate_n = 64 if touched * triton.cdiv(intermediate, 64) >= MIN_PROGRAMS else 32
        down_n = 64 if touched * triton.cdiv(hidden, 64) >= MIN_PROGRAMS else 32
        return MoeConfig(16, GemmTiles(gate_n, 128, 1, 4, 4), GemmTiles(down_n, 128, 1, 4, 4))
    if rows_per_expert <= 32:
        return MoeConfig(32, GemmTiles(64, 64, 8, 4, 4), GemmTiles(64, 64, 8, 4, 4))
    if rows_per_expert <= 128:
        return MoeConfig(64, GemmTiles(64, 64, 8, 4, 4), GemmTiles(128, 64, 8, 4, 3), True)
    if rows_per_expert <= 256:
        return MoeConfig(64, GemmTiles(128, 64, 8, 4, 4), GemmTiles(128, 64, 8, 4, 4), True)
    return MoeConfig(128, GemmTiles(64, 64, 8, 8, 3), GemmTiles(128, 64, 8, 8, 3), True)


@triton.jit
def _tile_of(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row block, column tile) of program pid: groups of GROUP_M row blocks (mostly one
    expert's) walk the column tiles together, their weight tiles shared in L2."""
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _swiglu(gate, up, B13, expert, stride_be, cols, inter_size, alpha, limit,
            HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr, GELU: tl.constexpr):  # fmt: skip
    """gate_up's epilogue from the fp32 sums: the biases (gpt-oss), then silu(gate) * up, the
    clamped SwiGLU, or (GELU) gelu_tanh(gate) * up, in fp32."""
    if HAS_BIAS:
        gate += tl.load(B13 + expert * stride_be + cols).to(tl.float32)[None, :]
        up += tl.load(B13 + expert * stride_be + inter_size + cols).to(tl.float32)[None, :]
    if CLAMP:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    if GELU:  # 0.5 * (1 + tanh(z)) == sigmoid(2 * z), z = sqrt(2 / pi) * (g + 0.044715 g^3)
        z = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)
        return gate * tl.sigmoid(z) * up
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _gate_up_kernel(
    X,  # [T, H]
    W13,  # [E, 2I, H]
    Inter,  # [N, I]: silu(gate) * up per routed row
    SortedIds,  # int32 [num_blocks * BLOCK_M]
    ExpertIds,  # int32 [num_blocks]
    NumPadded,  # int32 [1]
    num_rows,  # N = T * k, the padding's sentinel
    top_k,
    inter_size,  # I
    hidden,  # H: the K of this GEMM
    num_blocks,
    stride_xm,
    stride_we,
    stride_wn,
    stride_im,
    B13,  # HAS_BIAS: [E, 2I] gate then up
    stride_be,
    alpha,  # CLAMP: gpt-oss's SwiGLU
    limit,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMP: tl.constexpr,
    GELU: tl.constexpr,
):
    pid_m, pid_n = _tile_of(tl.program_id(0), num_blocks, tl.cdiv(inter_size, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M < tl.load(NumPadded):
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(SortedIds + offs_m)
        valid = rows < num_rows
        tokens = tl.where(valid, rows // top_k, 0).to(tl.int64)  # padding reads token 0
        expert = tl.load(ExpertIds + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.minimum(offs_n, inter_size - 1).to(tl.int64)  # past I: row I - 1 again
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = X + tokens[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        g_ptrs = W13 + expert * stride_we + cols[None, :] * stride_wn + offs_k[:, None]
        u_ptrs = g_ptrs + inter_size * stride_wn  # the up rows follow the gate rows
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(hidden, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                g = tl.load(g_ptrs)
                u = tl.load(u_ptrs)
            else:
                k_left = hidden - kb * BLOCK_K
                a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                g = tl.load(g_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
                u = tl.load(u_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            gate = tl.dot(a, g, gate)
            up = tl.dot(a, u, up)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        h = _swiglu(gate, up, B13, expert, stride_be, cols, inter_size, alpha, limit, HAS_BIAS,
                    CLAMP, GELU)  # fmt: skip
        out_ptrs = Inter + rows.to(tl.int64)[:, None] * stride_im + offs_n[None, :]
        mask = valid[:, None] & (offs_n < inter_size)[None, :]
        tl.store(out_ptrs, h.to(Inter.dtype.element_ty), mask=mask)


@triton.jit
def _store_weighted(acc, Out, TopkWeights, B2, rows, num_rows, expert, stride_be, offs_n, hidden,
                    stride_om, HAS_BIAS: tl.constexpr):  # fmt: skip
    """down's epilogue: the bias (gpt-oss), times each routed row's top-k weight (fp32), to
    out[rows] (the padding's sentinel rows, num_rows, not stored)."""
    valid = rows < num_rows
    if HAS_BIAS:
        cols = tl.minimum(offs_n, hidden - 1).to(tl.int64)
        acc += tl.load(B2 + expert * stride_be + cols).to(tl.float32)[None, :]
    weight = tl.load(TopkWeights + tl.where(valid, rows, 0), mask=valid, other=0.0)
    acc = acc * weight[:, None]
    out_ptrs = Out + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    mask = valid[:, None] & (offs_n < hidden)[None, :]
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _down_kernel(
    Inter,  # [N, I]
    W2,  # [E, H, I]
    Out,  # [N, H]: each routed row's weighted expert output
    TopkWeights,  # float32 [N]
    SortedIds,
    ExpertIds,
    NumPadded,
    num_rows,
    hidden,  # H: the N of this GEMM
    inter_size,  # I: the K of this GEMM
    num_blocks,
    stride_im,
    stride_we,
    stride_wn,
    stride_om,
    B2,  # HAS_BIAS: [E, H]
    stride_be,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid_m, pid_n = _tile_of(tl.program_id(0), num_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M < tl.load(NumPadded):
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(SortedIds + offs_m)
        valid = rows < num_rows
        safe_rows = tl.where(valid, rows, 0).to(tl.int64)  # padding reads row 0
        expert = tl.load(ExpertIds + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.minimum(offs_n, hidden - 1).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = Inter + safe_rows[:, None] * stride_im + offs_k[None, :]
        b_ptrs = W2 + expert * stride_we + cols[None, :] * stride_wn + offs_k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(inter_size, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_left = inter_size - kb * BLOCK_K
                a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        _store_weighted(acc, Out, TopkWeights, B2, rows, num_rows, expert, stride_be, offs_n,
                        hidden, stride_om, HAS_BIAS)  # fmt: skip


def _check_shapes(x, w13, w2, topk_weights, topk_ids) -> None:
    num_tokens, hidden = x.shape
    num_experts, two_i, w_hidden = w13.shape
    assert w_hidden == hidden and two_i % 2 == 0, f"x {list(x.shape)}, w13 {list(w13.shape)}"
    assert w2.shape == (num_experts, hidden, two_i // 2), f"w2 {list(w2.shape)}, w13 [E, 2I, H]"
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens, (
        f"topk_ids {list(topk_ids.shape)}, topk_weights {list(topk_weights.shape)}, T {num_tokens}"
    )
    assert topk_weights.dtype == torch.float32, f"topk_weights are {topk_weights.dtype}"
    assert x.dtype == w13.dtype == w2.dtype, f"x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}"
    assert x.stride(-1) == w13.stride(-1) == w2.stride(-1) == 1, "unit stride along H and I"


GATE_ACTS = ("silu", "gelu_pytorch_tanh")  # the experts' gate activations the epilogues run


def unpack_extras(extras, w13: torch.Tensor, w2: torch.Tensor) -> tuple:
    """(b13, b2, alpha, limit, gelu) of `extras` (layers/moe.py's ExpertExtras: gpt-oss's biases
    and clamped SwiGLU, Gemma 4's GELU-tanh gate), checked against the experts; (None, None, 1.0,
    0.0, False) for None: no biases, plain SiLU."""
    if extras is None:
        return None, None, 1.0, 0.0, False
    b13, b2 = extras.b13, extras.b2
    for b, rows in ((b13, w13.shape[1]), (b2, w2.shape[1])):
        assert b is None or (b.shape == (w13.shape[0], rows) and b.stride(-1) == 1), b
    if extras.act not in GATE_ACTS:
        raise ValueError(f"the fused experts run gate activations {GATE_ACTS}; got {extras.act!r}")
    gelu = extras.act == "gelu_pytorch_tanh"
    assert not (gelu and extras.limit), "a clamped SwiGLU has a SiLU gate"
    return b13, b2, float(extras.alpha), float(extras.limit), gelu


def takes_descriptors(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the gathered path's TMA descriptors can read these operands: contiguous weights
    and rows of H and I elements in whole 16-byte units (the descriptors' stride rule)."""
    elem = x.element_size()
    return (
        w13.is_contiguous()
        and w2.is_contiguous()
        and (x.shape[1] * elem) % 16 == 0
        and (w2.shape[2] * elem) % 16 == 0
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeConfig | None = None,
    extras=None,
) -> torch.Tensor:
    """y [T, H] in x's dtype, as the module docstring says; `config` overrides the rule;
    `extras` (layers/moe.py's ExpertExtras: b13, b2, alpha, limit, act) gpt-oss's biases and
    clamped SwiGLU, Gemma 4's GELU-tanh gate."""
    _check_shapes(x, w13, w2, topk_weights, topk_ids)
    b13, b2, alpha, limit, gelu = unpack_extras(extras, w13, w2)
    num_tokens, hidden = x.shape
    num_experts, inter_size = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    y = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return y
    chunk = tokens_per_pass(top_k)
    max_rows = min(num_tokens, chunk) * top_k
    inter = torch.empty((max_rows, inter_size), dtype=x.dtype, device=x.device)
    out = torch.empty((max_rows, hidden), dtype=x.dtype, device=x.device)
    weights = topk_weights.contiguous()
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        num_rows = (end - start) * top_k
        c = config or pick_config(tile_tokens(end - start), num_experts, top_k, hidden, inter_size)
        align = align_by_expert(topk_ids[start:end], num_experts, c.block_m)
        blocks = max_blocks(num_rows, num_experts, c.block_m)
        if c.gather and takes_descriptors(x, w13, w2):
            from batchrun.kernels.fused_moe_tma import gathered_experts

            gathered_experts(x[start:end], w13, w2, weights[start:end].view(-1), align, blocks,
                             num_rows, top_k, c, out, b13, b2, alpha, limit, gelu)  # fmt: skip
            torch.sum(out[:num_rows].view(end - start, top_k, hidden), dim=1, out=y[start:end])
            continue
        common = (align.sorted_ids, align.expert_ids, align.num_padded, num_rows)
        g = c.gate_up
        _gate_up_kernel[(blocks * triton.cdiv(inter_size, g.block_n),)](
            x[start:end],
            w13,
            inter,
            *common,
            top_k,
            inter_size,
            hidden,
            blocks,
            x.stride(0),
            w13.stride(0),
            w13.stride(1),
            inter.stride(0),
            w13 if b13 is None else b13,  # (a stand-in that HAS_BIAS prunes)
            0 if b13 is None else b13.stride(0),
            alpha,
            limit,
            BLOCK_M=c.block_m,
            BLOCK_N=g.block_n,
            BLOCK_K=g.block_k,
            GROUP_M=g.group_m,
            EVEN_K=hidden % g.block_k == 0,
            HAS_BIAS=b13 is not None,
            CLAMP=limit > 0,
            GELU=gelu,
            num_warps=g.num_warps,
            num_stages=g.num_stages,
        )
        d = c.down
        _down_kernel[(blocks * triton.cdiv(hidden, d.block_n),)](
            inter,
            w2,
            out,
            weights[start:end].view(-1),
            *common,
            hidden,
            inter_size,
            blocks,
            inter.stride(0),
            w2.stride(0),
            w2.stride(1),
            out.stride(0),
            w2 if b2 is None else b2,
            0 if b2 is None else b2.stride(0),
            BLOCK_M=c.block_m,
            BLOCK_N=d.block_n,
            BLOCK_K=d.block_k,
            GROUP_M=d.group_m,
            EVEN_K=inter_size % d.block_k == 0,
            HAS_BIAS=b2 is not None,
            num_warps=d.num_warps,
            num_stages=d.num_stages,
        )
        torch.sum(out[:num_rows].view(end - start, top_k, hidden), dim=1, out=y[start:end])
    return y
