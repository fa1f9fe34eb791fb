"""Block-wise FP8 matmul on the FP8 tensor cores (sm_89+):

    y[M, N] = (xq * sx) @ (w * sw)^T         bf16 (or fp16) out, fp32 accumulation

    xq  float8_e4m3fn [M, K]     activations quantized per token and group of 128 columns
    sx  float32 [M, K / 128]     (kernels/fp8_quant.py's quant_per_token_group; any strides)
    w   float8_e4m3fn [N, K]     the weight as stored (`quant_method: fp8` with
    sw  float32 [N / 128, K / 128]   weight_block_size [128, 128], compressed-tensors FP8_BLOCK)

The K loop steps one 128-column block at a time: tl.dot of the fp8 tiles gives that block's
partial sums, which are scaled by sx[:, k] * sw[n / 128, k] and added to the fp32 accumulator.
The tensor cores' sums span only 128 products, and the scales apply exactly where they change.

A program computes one [BLOCK_M, BLOCK_N] tile of y; programs are ordered in groups of GROUP_M
row tiles so that the weight tiles they share are read from L2. Configs come from a table by M
(no autotuning: it costs start-up and cannot run inside graph capture):

    M <= 16     decode: few rows, the weight streamed once; narrow tiles for enough programs
    M <= 64     decode batches
    M <= 256    small prefills / large decode batches
    larger      prefill: 128 x 128 tiles, 8 warps

`scripts/bench_fp8_matmul.py` times it on the H200 against torch._scaled_mm (per-channel) and
bf16 F.linear at the llama-8b shapes, and `--sweep` tries the other configs of each bucket.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

BLOCK = 128  # the weight's blocks (rows and columns) and the activations' groups


class BlockMatmulConfig(NamedTuple):
    block_m: int
    block_n: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


# (largest M, config), in increasing M
CONFIGS: tuple[tuple[int, BlockMatmulConfig], ...] = (
    (16, BlockMatmulConfig(16, 64, 1, 4, 4)),
    (64, BlockMatmulConfig(64, 64, 1, 4, 4)),
    (256, BlockMatmulConfig(64, 128, 8, 4, 3)),
    (1 << 62, BlockMatmulConfig(128, 128, 8, 8, 3)),
)


def pick_config(num_rows: int, out_features: int) -> BlockMatmulConfig:
    """The table's config for M = num_rows; a decode matmul whose N gives fewer than 128
    column tiles of 64 takes tiles of 32 (more programs in flight on the 132 SMs)."""
    config = next(c for max_m, c in CONFIGS if num_rows <= max_m)
    if num_rows <= 16 and out_features < 128 * 64:
        config = config._replace(block_n=32)
    return config


@triton.jit
def _block_matmul_kernel(
    A,  # float8 [M, K]
    B,  # float8 [N, K]
    C,  # [M, N]
    AS,  # float32 [M, cdiv(K, 128)]
    BS,  # float32 [cdiv(N, 128), cdiv(K, 128)]
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_asm,
    stride_ask,
    stride_bsn,
    stride_bsk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # the scales' block: one scale per K step
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks along K
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # groups of GROUP_M row tiles walk the column tiles together (their weight tiles in L2)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows / columns past M / N read row M - 1 / N - 1 again (in bounds, never stored)
    rows = tl.minimum(offs_m, M - 1).to(tl.int64)
    cols = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + rows[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = B + cols[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]: w^T
    as_ptrs = AS + rows * stride_asm  # [BLOCK_M]
    bs_ptrs = BS + (cols // BLOCK_K) * stride_bsn  # [BLOCK_N]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        sa = tl.load(as_ptrs + kb * stride_ask)
        sb = tl.load(bs_ptrs + kb * stride_bsk)
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    c_ptrs = C + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=mask)


def block_fp8_matmul(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    config: BlockMatmulConfig | None = None,
) -> torch.Tensor:
    """y [M, N] = (xq * x_scale) @ (weight * weight_scale)^T in out_dtype; the scales per
    128-column group (x) and 128 x 128 block (weight), as the module docstring says."""
    num_rows, cols = xq.shape
    out_features = weight.shape[0]
    assert weight.shape[1] == cols, f"x is [{num_rows}, {cols}], the weight {list(weight.shape)}"
    assert xq.stride(-1) == 1 and weight.stride(-1) == 1, "xq and weight need unit stride along K"
    num_k = triton.cdiv(cols, BLOCK)
    assert x_scale.shape == (num_rows, num_k), f"x_scale {list(x_scale.shape)}"
    assert weight_scale.shape == (triton.cdiv(out_features, BLOCK), num_k), (
        f"weight_scale {list(weight_scale.shape)}"
    )
    y = torch.empty((num_rows, out_features), dtype=out_dtype, device=xq.device)
    if num_rows == 0:
        return y
    c = config or pick_config(num_rows, out_features)
    grid = (triton.cdiv(num_rows, c.block_m) * triton.cdiv(out_features, c.block_n),)
    _block_matmul_kernel[grid](
        xq,
        weight,
        y,
        x_scale,
        weight_scale,
        num_rows,
        out_features,
        cols,
        xq.stride(0),
        weight.stride(0),
        y.stride(0),
        x_scale.stride(0),
        x_scale.stride(1),
        weight_scale.stride(0),
        weight_scale.stride(1),
        BLOCK_M=c.block_m,
        BLOCK_N=c.block_n,
        BLOCK_K=BLOCK,
        GROUP_M=c.group_m,
        EVEN_K=cols % BLOCK == 0,
        num_warps=c.num_warps,
        num_stages=c.num_stages,
    )
    return y
