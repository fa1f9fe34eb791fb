"""The depthwise causal conv1d with SiLU of a hybrid model's Gated DeltaNet layers, over a packed
batch of requests, each continuing from its conv state in the state pool (engine/state_pool.py):

    out = causal_conv1d(x, weight, states, rows, cu_seqlens, max_len)

    x           [T, C]           the step's new inputs, request after request (cu_seqlens)
    weight      [C, K]           the conv's taps
    states      [R, C, K-1]      one pool layer's conv states; request b's is states[rows[b]]
    out         [T, C]           silu(conv), in x's dtype

Request b's token at position p (0-based among its new tokens) reads the window of inputs
p-K+1 .. p, where an input before its first new token comes from its state:

    state[row] (K-1 older inputs) | x[bos:eos] (new)       the window of token p: K inputs
    new state[row] = the last K-1 of  state[row] | x[bos:eos]

Two launches: the conv (reads the states), then the state update (each program loads its
states and inputs before it stores). A decode batch is the case of one token a request, and
its launches have the same grid for every call of a batch size (CUDA graphs capture them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16
BLOCK_C = 128


@triton.jit
def _conv_kernel(
    X, W, States, Rows, CuSeqlens, Out,
    stride_x, stride_out, stride_w, stride_row, stride_c,
    C,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    bos = tl.load(CuSeqlens + b).to(tl.int64)
    seq_len = tl.load(CuSeqlens + b + 1).to(tl.int64) - bos
    if t0 >= seq_len:
        return
    row = tl.load(Rows + b).to(tl.int64)
    t = t0 + tl.arange(0, BLOCK_T)  # [BT] positions among the request's new tokens
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    t_ok = t < seq_len
    c_ok = c < C
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(K):
        p = t - (K - 1) + j  # [BT] the input position this tap reads (< 0: the state)
        new = p >= 0
        xv = tl.load(
            X + (bos + p)[:, None] * stride_x + c[None, :],
            mask=(t_ok & new)[:, None] & c_ok[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip
        sv = tl.load(
            States + row * stride_row + c[None, :] * stride_c + (K - 1 + p)[:, None],
            mask=(t_ok & ~new)[:, None] & c_ok[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip
        w = tl.load(W + c * stride_w + j, mask=c_ok, other=0.0).to(tl.float32)
        acc += (xv + sv) * w[None, :]
    out = acc / (1.0 + tl.exp(-acc))  # SiLU
    tl.store(
        Out + (bos + t)[:, None] * stride_out + c[None, :],
        out.to(Out.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :],
    )  # fmt: skip


@triton.jit
def _state_kernel(
    X, States, Rows, CuSeqlens,
    stride_x, stride_row, stride_c,
    C,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    bos = tl.load(CuSeqlens + b).to(tl.int64)
    seq_len = tl.load(CuSeqlens + b + 1).to(tl.int64) - bos
    row = tl.load(Rows + b).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    i = tl.arange(0, BLOCK_K)  # [BK] the new state's columns
    ok = (c < C)[:, None] & (i < K - 1)[None, :]
    src = seq_len + i  # [BK] column i's index in  state | new inputs
    old = src < K - 1
    base = States + row * stride_row + c[:, None] * stride_c
    sv = tl.load(base + src[None, :], mask=ok & old[None, :], other=0.0)
    xv = tl.load(
        X + (bos + src - (K - 1))[None, :] * stride_x + c[:, None],
        mask=ok & ~old[None, :], other=0.0,
    ).to(sv.dtype)  # fmt: skip
    tl.store(base + i[None, :], tl.where(old[None, :], sv, xv), mask=ok)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    states: torch.Tensor,
    rows: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
) -> torch.Tensor:
    """silu(causal conv1d) of the packed requests' new inputs x [T, C] after their states
    (states[rows[b]], [C, K-1] each), which it advances in place. weight [C, K]; cu_seqlens
    [B+1] on the device; max_len: the longest request's new tokens (the host's: it sizes the
    grid)."""
    num_tokens, channels = x.shape
    kernel = weight.shape[1]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and states.stride(2) == 1
    assert states.shape[1:] == (channels, kernel - 1), (states.shape, x.shape, weight.shape)
    out = torch.empty_like(x)
    num_reqs = rows.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    blocks_c = triton.cdiv(channels, BLOCK_C)
    grid = (num_reqs, triton.cdiv(max_len, BLOCK_T), blocks_c)
    _conv_kernel[grid](
        x, weight, states, rows, cu_seqlens, out,
        x.stride(0), out.stride(0), weight.stride(0), states.stride(0), states.stride(1),
        channels, K=kernel, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C,
    )  # fmt: skip
    if kernel > 1:
        _state_kernel[(num_reqs, blocks_c)](
            x, states, rows, cu_seqlens,
            x.stride(0), states.stride(0), states.stride(1),
            channels, K=kernel, BLOCK_K=triton.next_power_of_2(kernel - 1), BLOCK_C=BLOCK_C,
        )  # fmt: skip
    return out
