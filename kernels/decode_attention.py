"""Flash-decoding over the token-indexed paged KV: one query token per request, split KV.

    stage 1, grid (num_kv_heads, B, num_kv_splits): a request's KV heads in adjacent programs,
        which then read its tokens' whole KV rows together (2 KiB a token on llama-8b, not
        256-byte pieces of many requests)
        split s of request b covers KV positions
            [lo + s * split_len, min(lo + (s + 1) * split_len, seq_len))
        with split_len = ceil((seq_len - lo) / num_kv_splits) rounded up to BLOCK_N, computed on
        the device from seq_lens; lo is 0, or with a sliding window W max(0, seq_len - W): the
        positions before the window are never loaded. The program reads that range once for
        all H / KV query heads of its KV head (GQA) and writes the normalized partial output
        acc / l and its base-2 log-sum-exp.
        An empty split writes acc = 0, lse = -1e30: weight 0 next to any non-empty split.
    combine (stage 2), per query head
        out = sum_s 2^(lse_s - max) * acc_s / sum_s 2^(lse_s - max)
    With one split, stage 1 writes acc / l to out itself and there is no combine (for a large
    batch, with no split, a combine would copy every output: 1.7 % of a llama-8b decode step at
    batch 256, `scripts/profile_decode.py --model llama-8b --batch 256`).

The combine runs inside stage 1: every split program, after its partial stores, passes a CTA
barrier and adds 1 to its (b, kv head) counter (acq_rel, GPU scope); the program that sees
num_kv_splits - 1 is the last, combines the KV_GROUP heads of its KV head and resets the counter
to 0. Why: at batch 1 a second small kernel a layer costs more than the combine inside stage 1
(docs/benchmarks.md, Kernels: Decode attention).
NOTE: the last program reads every split back from memory, its own included, and sums them in
a fixed order, so the result does not depend on which split finished last. It loads all its
heads' partials at once ([KV_GROUP, splits, D]) before any reduction: head by head, each head's
loads would wait behind the reductions of the head before, an L2 round trip a head.

With `rope=DecodeRope(...)`, q and the new tokens' k come unrotated (straight from the qkv
matmul): every split program rotates its q heads and the new k in registers (the bits of
kernels/rotary_kv_store.py), the program whose split holds the new token stores it in the pool,
and each program reads its first KV block, its position's cos / sin and the new token's slot
before its PDL wait (the older tokens and the step's inputs were written two or more kernels
back), leaving the new token out of every load. One launch a layer fewer than rotary_kv_store +
this kernel; the backend takes it for decode graphs of up to 16 rows.

A float8_e4m3fn pool (`kv_scale=` given): K and V blocks are converted as they are loaded (exact)
to q's dtype, or with bf16 queries to fp16 with q and the softmax weights (FP8_FP16_DOT); the
layer's k scale is folded into the softmax scale and its v scale multiplies the normalized output
(the partials too: the combine is linear in them). With fp16 dots V is read as int32 words of
four values (V_WORDS) and its four column classes d = 4i + r go through four dots into four
accumulators, interleaved back at the end: V's operand of p @ v runs along the tokens, which
are rows apart, so the float8 tile's own load into it reads shared memory a byte at a time (128
one-byte loads a thread a 128-token block at D 128), and the words a word at a time (the loop's
SASS 1,097 instructions against 776; scripts/check_kernels_compile.py --sass, Triton 3.6).
With `rope`, the new token's k and v are quantized before the store (kernels/kv_store.py's
`quantize_e4m3`) and attended as stored, as every other token.

Attention sinks (gpt-oss, `sinks=` [H] fp32): split 0 of each request starts its online softmax
from the head's sink logit (max = sink * log2(e), sum = 1, acc = 0), so the sink's term enters
the denominator once, through split 0's partial and its log-sum-exp in the combine.

BLOCK_N and the stages shrink where the tiles would not fit the device's shared memory (head
dim 512: kernels/tile_fit.py's rule).

The grid depends only on B, the KV head count and num_kv_splits, and nothing is read back to the
host, so the launches can be captured in a CUDA graph and replayed with other seq_lens.

    workspace (fp32, decode_workspace_numel(B, H, D, S) elements, reused between calls):
        [0, B*H*S*D)              partial outputs   [B, H, S, D]
        [B*H*S*D, B*H*S*(D+1))    partial lse       [B, H, S]
    counters (int32, decode_counters(B, KV): zeros, >= B*KV elements, reused between calls):
        [b * KV + kv_head]        splits of (b, kv_head) done; every call leaves them 0 again,
                                  so one buffer serves every layer and graph replay, no memset
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl
from batchrun.kernels.fused_rotary import check_cos_sin
from batchrun.kernels.kv_store import quantize_e4m3
from batchrun.kernels.pdl import pdl_launch_kwargs, pdl_wait
from batchrun.kernels.tile_fit import fit_kv_tiles, shared_memory_limit

if TYPE_CHECKING:
    from batchrun.quant.kv_cache import KVScale

LOG2E = 1.4426950408889634
FOLD_BLOCK_S = 16  # the folded combine's split tile (TritonAttentionBackend's MAX_KV_SPLITS)

# defaults: the sweep's best on the H200 (64 x 1024 tokens, GQA 32/8, D 128, bf16;
# docs/benchmarks.md, Kernels: Decode attention)
DEFAULT_BLOCK_N = 64
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3
# a float8 pool's tokens take half the bytes: 128 a block, faster than 64 at long and at short
# contexts (docs/benchmarks.md, Kernels: Decode attention)
FP8_BLOCK_N = 128
# a float8 pool read by bf16 queries: e4m3 converts to fp16 in one instruction a pair (to bf16
# through fp32), and fp16 holds every e4m3 value and softmax weight at least as well as bf16;
# q converts to fp16 (exact for |q| < 65504)
FP8_FP16_DOT = True


class DecodeRope(NamedTuple):
    """The new tokens' k and v before rotary, for the decode kernel that rotates q and k itself
    and stores the new KV (decode_attention_fwd(..., rope=)): kernels/rotary_kv_store.py's work
    inside the attention, one launch a layer fewer."""

    k: torch.Tensor  # [B, KV, D], unit stride along D
    v: torch.Tensor  # [B, KV, D], unit stride along D
    loc: torch.Tensor  # [B] int64 / int32: the KV slot of each request's new token
    positions: torch.Tensor  # [B] int64
    cos: torch.Tensor  # [P, D] fp32
    sin: torch.Tensor  # [P, D] fp32


@triton.jit
def _mul_rn(a, b, EXACT: tl.constexpr):
    """a * b in fp32, never contracted into an FMA with what follows (the rotary kernels are
    compiled without FMA contraction; this kernel keeps it for the attention). The interpreter
    has no inline asm, and numpy never contracts."""
    if EXACT:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    return a * b


@triton.jit
def _rope_rows(X, offs_rows, mask_rows, c, s, offs_d, mask_d, HALF: tl.constexpr,
               EXACT: tl.constexpr):  # fmt: skip
    """Rows X + offs_rows [R, BLOCK_D] rotated (neox, rotate-half) with c, s ([BLOCK_D] fp32
    holding the dtype's values): every product and the sum rounded to the dtype, the bits of
    kernels/fused_rotary.py's `_rotate_half`."""
    partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
    mask = mask_rows[:, None] & mask_d[None, :]
    x = tl.load(X + offs_rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
    xp = tl.load(X + offs_rows[:, None] + partner[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    zeros = tl.zeros(x.shape, dtype=tl.float32)  # the asm's operands of one shape
    p1 = _mul_rn(x.to(tl.float32), c[None, :] + zeros, EXACT).to(dtype).to(tl.float32)
    p2 = _mul_rn(xp.to(tl.float32), s[None, :] + zeros, EXACT).to(dtype).to(tl.float32)
    return tl.where((offs_d < HALF)[None, :], p1 - p2, p1 + p2).to(dtype)


@triton.jit
def _residues(x, BLOCK_D: tl.constexpr):
    """x [R, BLOCK_D] as its four column classes d = 4i + r, [R, BLOCK_D / 4] each (r = 0..3)."""
    x4 = tl.reshape(x, (x.shape[0], BLOCK_D // 4, 2, 2))  # [R, i, r // 2, r % 2]
    even, odd = tl.split(x4)
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def _fp8_words(w, ASM: tl.constexpr):
    """The four float8_e4m3fn values of each int32 word w (little-endian: byte r is the value
    at d = 4i + r) as fp16, exactly: (v0, v1, v2, v3). On the GPU two cvt.f16x2.e4m3x2 a word."""
    if ASM:
        v0, v1, v2, v3 = tl.inline_asm_elementwise(
            "{\n.reg .b16 lo, hi;\n.reg .b32 a, b;\nmov.b32 {lo, hi}, $4;\n"
            "cvt.rn.f16x2.e4m3x2 a, lo;\ncvt.rn.f16x2.e4m3x2 b, hi;\n"
            "mov.b32 {$0, $1}, a;\nmov.b32 {$2, $3}, b;\n}",
            "=h,=h,=h,=h,r",
            [w],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=1,
        )
    else:
        v0 = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        v1 = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        v2 = ((w >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        v3 = ((w >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return v0, v1, v2, v3


@triton.jit
def _attend_block(q, k, v0, v1, v2, v3, mask_n, m_i, l_i, a0, a1, a2, a3, sm_scale_log2,
                  DOT_PRECISION: tl.constexpr, V_WORDS: tl.constexpr):  # fmt: skip
    """One BLOCK_N block of KV folded into the running (max, sum, acc) of the online softmax.
    acc is a0 [BLOCK_H, BLOCK_D] with V v0 [BLOCK_N, BLOCK_D] (a1-a3, v1-v3 unused); with
    V_WORDS its column classes a0-a3 [BLOCK_H, BLOCK_D / 4] with V's, v0-v3."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2
    qk = tl.where(mask_n[None, :], qk, float("-inf"))  # [BLOCK_H, BLOCK_N]
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v0.dtype)
    a0 = a0 * alpha[:, None] + tl.dot(p, v0, input_precision=DOT_PRECISION)
    if V_WORDS:
        a1 = a1 * alpha[:, None] + tl.dot(p, v1, input_precision=DOT_PRECISION)
        a2 = a2 * alpha[:, None] + tl.dot(p, v2, input_precision=DOT_PRECISION)
        a3 = a3 * alpha[:, None] + tl.dot(p, v3, input_precision=DOT_PRECISION)
    return m_new, l_i, a0, a1, a2, a3


@triton.jit
def _kv_block(r2t, k_head, v_head, offs_n, load_mask, mask_d, stride_kt, stride_vt, offs_d,
              dtype: tl.constexpr, BLOCK_D: tl.constexpr, V_WORDS: tl.constexpr,
              ASM: tl.constexpr):  # fmt: skip
    """K [BLOCK_N, BLOCK_D] and V at positions offs_n of the request (zeros where not
    load_mask), in `dtype` (q's: a float8 pool's values convert exactly): (k, v, v, v, v), or
    with V_WORDS (a float8 pool, fp16 dots) (k, v0, v1, v2, v3), V's column classes read as
    int32 words of four values: the dot's operand then comes from shared memory a word at a time,
    where the float8 tile's own load into that operand's layout reads it a byte at a time."""
    # int64: slot * stride overflows int32 on large pools
    slots = tl.load(r2t + offs_n, mask=load_mask, other=0).to(tl.int64)
    kv_mask = load_mask[:, None] & mask_d[None, :]
    k_ptr = k_head + slots[:, None] * stride_kt + offs_d[None, :]
    k = tl.load(k_ptr, mask=kv_mask, other=0.0).to(dtype)
    if V_WORDS:
        offs_w = tl.arange(0, BLOCK_D // 4)
        words = v_head.to(tl.pointer_type(tl.int32), bitcast=True)
        w_ptr = words + slots[:, None] * (stride_vt // 4) + offs_w[None, :]
        w = tl.load(w_ptr, mask=load_mask[:, None], other=0)
        v0, v1, v2, v3 = _fp8_words(w, ASM)
    else:
        v_ptr = v_head + slots[:, None] * stride_vt + offs_d[None, :]
        v0 = tl.load(v_ptr, mask=kv_mask, other=0.0).to(dtype)
        v1, v2, v3 = v0, v0, v0
    return k, v0, v1, v2, v3


@triton.jit
def _new_token(k, v0, v1, v2, v3, k_new, v_new, is_new, BLOCK_D: tl.constexpr,
               V_WORDS: tl.constexpr):  # fmt: skip
    """K and V (_kv_block's) with the new token's row (is_new [BLOCK_N, 1]) taken from k_new,
    v_new [1, BLOCK_D]."""
    k = tl.where(is_new, k_new, k)
    if V_WORDS:
        n0, n1, n2, n3 = _residues(v_new, BLOCK_D)
        v0, v1 = tl.where(is_new, n0, v0), tl.where(is_new, n1, v1)
        v2, v3 = tl.where(is_new, n2, v2), tl.where(is_new, n3, v3)
    else:
        v0 = tl.where(is_new, v_new, v0)
        v1, v2, v3 = v0, v0, v0
    return k, v0, v1, v2, v3


# NOTE: no specialization on the split count, so 1 / 16 / others share one compiled kernel
@triton.jit(do_not_specialize=["num_kv_splits", "window"])
def _decode_stage1_kernel(
    Q,
    K,
    V,
    ReqToToken,
    ReqPoolIndices,
    SeqLens,
    PartialOut,
    PartialLse,
    Out,
    Counters,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_r2t,
    num_kv_splits,
    window,  # the sliding window: only the last `window` positions are read (0: all of them)
    sm_scale_log2,  # the softmax scale times log2(e), times the k scale of a float8 pool
    v_scale,  # KV_FP8: the layer's v scale, on the output
    k_inv_scale,  # KV_FP8 and ROTARY: the new token's quantization
    v_inv_scale,
    NUM_HEADS: tl.constexpr,
    KV_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: write the final output to Out, no partials
    FOLDED: tl.constexpr,  # the last split program of (b, kvh) combines (stage 2 folded in)
    BLOCK_S: tl.constexpr,  # >= num_kv_splits, a power of two, where FOLDED; else 1
    BLOCK_G: tl.constexpr,  # KV_GROUP's power of two (the folded combine's heads)
    KV_FP8: tl.constexpr,  # K and V hold float8_e4m3fn
    FP16_DOT: tl.constexpr,  # KV_FP8 with bf16 q: q, K, V and p as fp16 in the dots
    V_WORDS: tl.constexpr,  # KV_FP8 with fp16 dots: V read as int32 words (_kv_block)
    PDL: tl.constexpr,
    KNew,  # ROTARY: the new tokens' k and v before rotary [B, KV, D], their slots, positions
    VNew,
    Loc,
    Positions,
    Cos,
    Sin,
    stride_knb,
    stride_knh,
    stride_vnb,
    stride_vnh,
    stride_cos,
    stride_sin,
    ROTARY: tl.constexpr,  # q and the new k raw: rotate them here, store the new k and v
    HALF: tl.constexpr,
    ASM: tl.constexpr,  # on the GPU: inline PTX (exact rotary products, float8 words)
    Sinks,  # HAS_SINKS: [NUM_HEADS] fp32, each head's sink logit
    HAS_SINKS: tl.constexpr,
):
    if not ROTARY:
        pdl_wait(PDL)  # every input is an earlier kernel's output
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)

    row = tl.load(ReqPoolIndices + b).to(tl.int64)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # the first position seen
    split_len = tl.cdiv(tl.cdiv(seq_len - lo, num_kv_splits), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    heads = kvh * KV_GROUP + offs_h
    mask_h = offs_h < KV_GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    # NOTE: finite initial max, so that exp2(m_i - m_new) never sees -inf - -inf
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_SINKS:  # split 0 starts from the sink: max sink (base 2), sum 2^0 = 1
        sink = tl.load(Sinks + heads, mask=mask_h, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    # the running output: a0 [BLOCK_H, BLOCK_D], or with V_WORDS its four column classes
    a0 = tl.zeros([BLOCK_H, BLOCK_D // 4 if V_WORDS else BLOCK_D], dtype=tl.float32)
    a1, a2, a3 = a0, a0, a0
    r2t = ReqToToken + row * stride_r2t
    k_head = K + kvh * stride_kh
    v_head = V + kvh * stride_vh
    dtype = Q.dtype.element_ty
    cdtype = tl.float16 if FP16_DOT else dtype  # the dots' operands
    if ROTARY:
        # NOTE: the split's first KV block is read before the PDL wait: the pool's older tokens,
        # req_to_token and seq_lens were written two or more kernels back (the kernel before
        # this one passed its own wait before letting this one launch), and the HBM idles while
        # the qkv matmul drains. Only the new token (this step's, stored by this kernel) is
        # left out of every load and put in from registers.
        newest = seq_len - 1
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        k, v0, v1, v2, v3 = _kv_block(r2t, k_head, v_head, offs_n, mask_n & (offs_n != newest),
                                      mask_d, stride_kt, stride_vt, offs_d, cdtype, BLOCK_D,
                                      V_WORDS, ASM)  # fmt: skip
        # NOTE: the position, its cos / sin row and the new token's slot before the wait too:
        # the step's inputs (written at the step's start) and constant tables, so the two
        # dependent loads (position, then its row) leave the chain after the wait
        pos = tl.load(Positions + b).to(tl.int64)
        c = tl.load(Cos + pos * stride_cos + offs_d, mask=mask_d, other=0.0).to(dtype)
        sn = tl.load(Sin + pos * stride_sin + offs_d, mask=mask_d, other=0.0).to(dtype)
        c, sn = c.to(tl.float32), sn.to(tl.float32)
        slot = tl.load(Loc + b).to(tl.int64)
        pdl_wait(PDL)
        q = _rope_rows(Q + b * stride_qb, heads * stride_qh, mask_h, c, sn, offs_d, mask_d,
                       HALF, ASM).to(cdtype)  # fmt: skip
        one = tl.arange(0, 1)
        k_new = _rope_rows(
            KNew + b * stride_knb + kvh * stride_knh,
            one,
            one == 0,
            c,
            sn,
            offs_d,
            mask_d,
            HALF,
            ASM,
        )  # fmt: skip  [1, BLOCK_D]
        v_new = tl.load(VNew + b * stride_vnb + kvh * stride_vnh + offs_d, mask=mask_d, other=0.0)
        v_new = v_new[None, :]
        k_store, v_store = k_new, v_new
        if KV_FP8:  # attend to the new token as stored
            k_store = quantize_e4m3(k_new.to(tl.float32), k_inv_scale)
            v_store = quantize_e4m3(v_new.to(tl.float32), v_inv_scale)
            k_new, v_new = k_store.to(cdtype), v_store.to(cdtype)
        if (newest >= start) & (newest < end):  # this split holds the new token: store it
            tl.store(k_head + slot * stride_kt + offs_d[None, :], k_store, mask=mask_d[None, :])
            tl.store(v_head + slot * stride_vt + offs_d[None, :], v_store, mask=mask_d[None, :])
        # NOTE: the new token (the request's last position) can only be in the split's last
        # block: the first block and the last take it from registers, the blocks between load
        # every position (the plain loop: patching every block's tiles costs a shared-memory
        # round trip of K and V a block, 1,064 SASS instructions a block against 463 at D 128;
        # scripts/check_kernels_compile.py --sass)
        is_new = (offs_n == newest)[:, None]
        k, v0, v1, v2, v3 = _new_token(k, v0, v1, v2, v3, k_new, v_new, is_new, BLOCK_D, V_WORDS)
        m_i, l_i, a0, a1, a2, a3 = _attend_block(q, k, v0, v1, v2, v3, mask_n, m_i, l_i, a0, a1,
                                                 a2, a3, sm_scale_log2, DOT_PRECISION,
                                                 V_WORDS)  # fmt: skip
        last = start + tl.maximum(end - start - 1, 0) // BLOCK_N * BLOCK_N
        first_plain, end_plain = start + BLOCK_N, last
    else:
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None] & mask_d[None, :],
            other=0.0,
        ).to(cdtype)  # [BLOCK_H, BLOCK_D]
        first_plain, end_plain = start, end
    for n0 in range(first_plain, end_plain, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        k, v0, v1, v2, v3 = _kv_block(r2t, k_head, v_head, offs_n, mask_n, mask_d, stride_kt,
                                      stride_vt, offs_d, cdtype, BLOCK_D, V_WORDS,
                                      ASM)  # fmt: skip
        m_i, l_i, a0, a1, a2, a3 = _attend_block(q, k, v0, v1, v2, v3, mask_n, m_i, l_i, a0, a1,
                                                 a2, a3, sm_scale_log2, DOT_PRECISION,
                                                 V_WORDS)  # fmt: skip
    if ROTARY:
        if last > start:  # the split's last block, the new token from registers where it is
            offs_n = last + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            k, v0, v1, v2, v3 = _kv_block(r2t, k_head, v_head, offs_n,
                                          mask_n & (offs_n != newest), mask_d, stride_kt,
                                          stride_vt, offs_d, cdtype, BLOCK_D, V_WORDS,
                                          ASM)  # fmt: skip
            is_new = (offs_n == newest)[:, None]
            k, v0, v1, v2, v3 = _new_token(k, v0, v1, v2, v3, k_new, v_new, is_new, BLOCK_D,
                                           V_WORDS)  # fmt: skip
            m_i, l_i, a0, a1, a2, a3 = _attend_block(q, k, v0, v1, v2, v3, mask_n, m_i, l_i,
                                                     a0, a1, a2, a3, sm_scale_log2,
                                                     DOT_PRECISION, V_WORDS)  # fmt: skip

    acc = a0
    if V_WORDS:  # the column classes interleaved back: acc[:, 4i + r] = a_r[:, i]
        acc = tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (BLOCK_H, BLOCK_D))
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    l_out = l_safe  # acc / l_out: the output (the partial output)
    if KV_FP8:
        l_out = l_safe / v_scale  # ... times the v scale
    if DIRECT:
        tl.store(
            Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            (acc / l_out[:, None]).to(Out.dtype.element_ty),
            mask=mask_h[:, None] & mask_d[None, :],
        )
    else:
        lse = tl.where((end > start) | (l_i > 0.0), m_i + tl.log2(l_safe), -1.0e30)
        part = (b * NUM_HEADS + heads) * num_kv_splits + split  # [BLOCK_H]
        tl.store(
            PartialOut + part[:, None] * HEAD_DIM + offs_d[None, :],
            acc / l_out[:, None],
            mask=mask_h[:, None] & mask_d[None, :],
        )
        tl.store(PartialLse + part, lse, mask=mask_h)
        if FOLDED:
            _combine_if_last(
                PartialOut, PartialLse, Out, Counters, b, kvh, stride_ob, stride_oh,
                num_kv_splits, NUM_HEADS, KV_GROUP, HEAD_DIM, BLOCK_G, BLOCK_S, BLOCK_D,
            )  # fmt: skip


@triton.jit
def _combine_if_last(
    PartialOut,
    PartialLse,
    Out,
    Counters,
    b,
    kvh,
    stride_ob,
    stride_oh,
    num_kv_splits,
    NUM_HEADS: tl.constexpr,
    KV_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Count this split of (b, kvh) done; the last of them combines its KV_GROUP heads."""
    # NOTE: the barrier orders every thread's partial stores before the atomic, whose release at
    # GPU scope publishes them; the last program's acquire makes every other split's visible
    tl.debug_barrier()
    counter = Counters + b * (NUM_HEADS // KV_GROUP) + kvh
    done_before = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if done_before == num_kv_splits - 1:
        # NOTE: every head's partials in one load, before any reduction (the module docstring)
        offs_g = tl.arange(0, BLOCK_G)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        mask_g = offs_g < KV_GROUP
        mask_gs = mask_g[:, None] & (offs_s < num_kv_splits)[None, :]
        heads = kvh * KV_GROUP + offs_g
        part = (b * NUM_HEADS + heads)[:, None] * num_kv_splits + offs_s[None, :]  # [G, S]
        # .cg (L2, not L1): other CTAs wrote these during this launch, and L1 is not coherent
        lse = tl.load(PartialLse + part, mask=mask_gs, other=float("-inf"), cache_modifier=".cg")
        acc = tl.load(
            PartialOut + part[:, :, None] * HEAD_DIM + offs_d[None, None, :],
            mask=mask_gs[:, :, None] & (offs_d < HEAD_DIM)[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )  # [G, S, D]
        # split 0 always exists, so a real head's max is finite; padding heads get 0
        top = tl.where(mask_g, tl.max(lse, 1), 0.0)
        weight = tl.exp2(lse - top[:, None])
        total = tl.sum(weight, 1)
        out = tl.sum(weight[:, :, None] * acc, 1) / tl.where(total > 0.0, total, 1.0)[:, None]
        tl.store(
            Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=mask_g[:, None] & (offs_d < HEAD_DIM)[None, :],
        )
        # every split has counted (no one touches it again in this launch): ready for the next
        # call; the kernel's end publishes it, and the next launch reads it after its pdl_wait
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def decode_workspace_numel(batch_size: int, num_heads: int, head_dim: int, num_kv_splits: int):
    """fp32 elements the workspace needs for one call."""
    return batch_size * num_heads * num_kv_splits * (head_dim + 1)


def decode_counters(batch_size: int, num_kv_heads: int, device) -> torch.Tensor:
    """The zeroed int32 split counters for calls of up to batch_size requests (each call leaves
    them zero again, so allocate once and reuse)."""
    return torch.zeros(batch_size * num_kv_heads, dtype=torch.int32, device=device)


def decode_attention_fwd(
    q: torch.Tensor,  # [B, H, D]
    k_buf: torch.Tensor,  # [num_slots + 1, KV, D]
    v_buf: torch.Tensor,  # [num_slots + 1, KV, D]
    out: torch.Tensor,  # [B, H, D], written
    req_to_token: torch.Tensor,  # [max_reqs + 1, max_context] int32
    req_pool_indices: torch.Tensor,  # [B] int64
    seq_lens: torch.Tensor,  # [B] int64, KV length including the new token
    scaling: float,
    num_kv_splits: int,
    workspace: torch.Tensor,  # fp32, >= decode_workspace_numel(B, H, D, num_kv_splits)
    counters: torch.Tensor,  # int32, zeros, >= B * num_kv_heads (decode_counters), left zero
    *,
    window: int = 0,  # sliding window: attend over the last `window` positions (0: all)
    rope: DecodeRope | None = None,  # q (and rope.k) before rotary: rotate and store here
    kv_scale: KVScale | None = None,  # float8_e4m3fn buffers: the layer's scales
    pdl: bool = False,  # launched with programmatic dependent launch (kernels/pdl.py)
    block_n: int | None = None,  # tile configs for scripts/bench_attention_kernels.py's sweep
    num_warps: int | None = None,
    num_stages: int | None = None,
    fp16_dot: bool | None = None,  # KV_FP8 with bf16 q: the dots on fp16 (None: FP8_FP16_DOT)
    sinks: torch.Tensor | None = None,  # [H] fp32: each head's sink logit (gpt-oss)
    shared_memory: int | None = None,  # the tiles' byte limit (None: q's device's, if a GPU)
) -> None:
    batch_size, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert q.stride(2) == 1 and out.stride(2) == 1
    assert k_buf.stride(2) == 1 and v_buf.stride(2) == 1 and req_to_token.stride(1) == 1
    assert workspace.dtype == torch.float32
    numel = decode_workspace_numel(batch_size, num_heads, head_dim, num_kv_splits)
    assert workspace.numel() >= numel, "workspace too small"
    assert counters.dtype == torch.int32 and counters.numel() >= batch_size * num_kv_heads
    kv_fp8 = check_kv_scale(q, k_buf, v_buf, kv_scale)
    if batch_size == 0:
        return
    kv_group = num_heads // num_kv_heads
    split_size = batch_size * num_heads * num_kv_splits
    partial_out = workspace[: split_size * head_dim]
    partial_lse = workspace[split_size * head_dim : numel]
    block_d = triton.next_power_of_2(head_dim)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    folded = num_kv_splits > 1
    if rope is not None:
        assert rope.k.shape == rope.v.shape == (batch_size, num_kv_heads, head_dim)
        assert rope.k.stride(2) == 1 and rope.v.stride(2) == 1 and head_dim % 2 == 0
        assert rope.k.dtype == rope.v.dtype == q.dtype
        assert rope.loc.shape == rope.positions.shape == (batch_size,)
        check_cos_sin(rope.cos, rope.sin, head_dim)
    if sinks is not None:
        assert sinks.shape == (num_heads,) and sinks.dtype == torch.float32, sinks.shape
    # NOTE: without rope, its tensors' slots get stand-ins that the ROTARY constexpr prunes
    r = rope or DecodeRope(q, q, seq_lens, seq_lens, workspace[None, :], workspace[None, :])
    scale = kv_scale if kv_fp8 else None
    fp16_dot = FP8_FP16_DOT if fp16_dot is None else fp16_dot
    fp16_dot = kv_fp8 and q.dtype == torch.bfloat16 and fp16_dot
    # V's float8 tile as int32 words of four values (_kv_block): fp16 dots, whole words a row
    v_words = (
        kv_fp8
        and (fp16_dot or q.dtype == torch.float16)
        and head_dim == block_d
        and v_buf.stride(0) % 4 == 0
        and v_buf.stride(1) % 4 == 0
        and v_buf.data_ptr() % 4 == 0
    )

    block_h = max(16, triton.next_power_of_2(kv_group))  # tl.dot needs M >= 16
    # wide heads (Gemma 4's 512) shrink the KV tiles to the device's shared memory (tile_fit.py)
    block_n, num_stages = fit_kv_tiles(
        block_h,
        head_dim,
        block_n or (FP8_BLOCK_N if kv_fp8 else DEFAULT_BLOCK_N),
        num_stages or DEFAULT_NUM_STAGES,
        2 if fp16_dot else q.element_size(),
        k_buf.element_size(),
        shared_memory if shared_memory is not None else shared_memory_limit(q.device),
        pipelined=False,
    )
    launch = pdl_launch_kwargs(pdl, q)
    _decode_stage1_kernel[(num_kv_heads, batch_size, num_kv_splits)](
        q,
        k_buf,
        v_buf,
        req_to_token,
        req_pool_indices,
        seq_lens,
        partial_out,
        partial_lse,
        out,
        counters,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        req_to_token.stride(0),
        num_kv_splits,
        max(window, 0),
        scaling * LOG2E * (scale.k if scale else 1.0),
        scale.v if scale else 1.0,
        scale.inv_k if scale else 1.0,
        scale.inv_v if scale else 1.0,
        NUM_HEADS=num_heads,
        KV_GROUP=kv_group,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=precision,
        DIRECT=num_kv_splits == 1,
        FOLDED=folded,
        # NOTE: one folded variant for every split count up to FOLD_BLOCK_S: mixed steps decode
        # batches of any size eagerly, so a variant per power of two would compile mid-run
        # (W1 llama-1b then reads ~30 % lower on the H200, as one-off compile stalls would)
        BLOCK_S=max(FOLD_BLOCK_S, triton.next_power_of_2(num_kv_splits)) if folded else 1,
        BLOCK_G=triton.next_power_of_2(kv_group),
        KV_FP8=kv_fp8,
        FP16_DOT=fp16_dot,
        V_WORDS=v_words,
        num_warps=num_warps or DEFAULT_NUM_WARPS,
        num_stages=num_stages,
        **launch,
        KNew=r.k,
        VNew=r.v,
        Loc=r.loc,
        Positions=r.positions,
        Cos=r.cos,
        Sin=r.sin,
        stride_knb=r.k.stride(0),
        stride_knh=r.k.stride(1),
        stride_vnb=r.v.stride(0),
        stride_vnh=r.v.stride(1),
        stride_cos=r.cos.stride(0),
        stride_sin=r.sin.stride(0),
        ROTARY=rope is not None,
        HALF=head_dim // 2,
        ASM=q.is_cuda,
        Sinks=q if sinks is None else sinks,  # (a stand-in that HAS_SINKS prunes)
        HAS_SINKS=sinks is not None,
    )


def check_kv_scale(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_scale) -> bool:
    """Whether the buffers hold float8_e4m3fn (then read with `kv_scale`; None: 1.0); else they
    hold q's dtype."""
    assert k_buf.dtype == v_buf.dtype
    if k_buf.dtype == torch.float8_e4m3fn:
        return True
    assert k_buf.dtype == q.dtype and kv_scale is None, (q.dtype, k_buf.dtype, kv_scale)
    return False
