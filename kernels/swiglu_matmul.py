"""A batch's gate_up matmul with the SwiGLU gate as its epilogue: out = silu(x @ w_gate.T) *
(x @ w_up.T), for w = [gate rows | up rows] ([2 * I, K]) and x [M, K], in one kernel.

    program (pid_m, pid_n): rows [m, m + BM) of x, columns [n, n + BN) of both halves
        for each K tile:  a = x[m:, k:]  (TMA)       acc_g += a @ w[n:, k:].T
                          b_g, b_u = w[n:, k:], w[I + n:, k:]   acc_u += a @ w[I + n:, k:].T
        epilogue:         out[m:, n:] = silu(acc_g) * acc_u   (rounded as the unfused path)

Why: unfused, the gate_up matmul writes [M, 2 * I] and a second kernel (kernels/activation.py)
reads it back to write [M, I]: ~2.2 % of W1 llama-8b's GPU time (sixteenth session's profile).
The tile's two accumulators are a [BM, 2 * BN] tile of the ordinary product, so the matmul does
the same work; only the gate moves into it. Tiles run in groups of GROUP_M row tiles over the
same columns (the grouped order: a weight tile is read by GROUP_M row tiles while in L2).

Numerics: gate and up rounded to the dtype (the unfused matmul's output), silu rounded, the
product once: kernels/gemv.py's `_swiglu`, the same as silu_and_mul after a matmul. The sums'
order is this kernel's (not cuBLAS's), so a value may differ from the unfused one by the last
bits of the matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchrun.kernels.gemv import _swiglu
from triton.tools.tensor_descriptor import TensorDescriptor

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages); BLOCK_N is each half's width
DEFAULT_CONFIG = (128, 128, 64, 8, 8, 3)


@triton.jit
def _swiglu_matmul_kernel(
    x_desc,
    w_desc,
    out_desc,
    M,
    inter_size,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(inter_size, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # NOTE: a gate tile past inter_size reads up rows (the descriptor spans both halves): those
    # columns are past the output's edge, and its store drops them
    for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES):
        a = x_desc.load([off_m, k * BLOCK_K])
        b_g = w_desc.load([off_n, k * BLOCK_K])
        b_u = w_desc.load([inter_size + off_n, k * BLOCK_K])
        acc_g = tl.dot(a, b_g.T, acc_g)
        acc_u = tl.dot(a, b_u.T, acc_u)
    dtype = out_desc.dtype
    out_desc.store([off_m, off_n], _swiglu(acc_g, acc_u, dtype).to(dtype))


def swiglu_matmul(
    x: torch.Tensor,  # [M, K], bf16 / fp16, unit stride along K
    weight: torch.Tensor,  # [2 * I, K]: gate rows, then up rows
    out: torch.Tensor | None = None,  # [M, I]
    config: tuple[int, int, int, int, int, int] = DEFAULT_CONFIG,
) -> torch.Tensor:
    m, k = x.shape
    two_inter, k_w = weight.shape
    assert k == k_w and two_inter % 2 == 0, (x.shape, weight.shape)
    assert x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
    assert x.stride(1) == 1 and weight.stride(1) == 1
    inter = two_inter // 2
    if out is None:
        out = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    assert out.shape == (m, inter) and out.dtype == x.dtype and out.stride(1) == 1
    if m == 0:
        return out
    block_m, block_n, block_k, group_m, num_warps, num_stages = config
    grid = (triton.cdiv(m, block_m) * triton.cdiv(inter, block_n),)
    _swiglu_matmul_kernel[grid](
        TensorDescriptor.from_tensor(x, [block_m, block_k]),
        TensorDescriptor.from_tensor(weight, [block_n, block_k]),
        TensorDescriptor.from_tensor(out, [block_m, block_n]),
        m, inter, k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        NUM_STAGES=num_stages, num_warps=num_warps,
    )  # fmt: skip
    return out
