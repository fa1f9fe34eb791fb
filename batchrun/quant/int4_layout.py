"""INT4 weights in the layout of the W4A16 kernel (kernels/int4_matmul.py), made at load from an
Int4Weight (batchrun/quant/weights.py: [out, in] unpacked, whatever the checkpoint's packing).
Pure torch: the packing runs, and is tested, without Triton.

    qweight  int32 [K, N / 8]         word (k, c) holds q[8c + j, k] in bits [4j, 4j + 4)
    scales   [num_groups, N]          the checkpoint's float dtype; row g: group g's scales
    zeros    uint8 [num_groups, N]    the zero points; None where every one is 8 (symmetric)
    perm     int64 [K] | None         act-order: the kernel's column k is column perm[k] of x
    groups   int32 [K] | None         the group of each of the kernel's columns, where they are
                                      not runs of group_size (see below); None: k // group_size

W[n, perm[k]] = (q - zeros[g, n]) * scales[g, n] with g = groups[k] (or k // group_size).

mma_pack reorders a plain (no act-order) weight's words for kernels/int4_gemv_mma.py, the
tensor-core decode GEMV candidate (Int4MmaPacked: each thread's MMA fragments in one 16-byte
load), sharing the scales and zeros.

Why this layout:
- K-major words of 8 consecutive output columns (AWQ's GEMM layout, nibbles in plain order): a
  kernel tile [BLOCK_K, BLOCK_N] is BLOCK_K rows of BLOCK_N / 8 consecutive words, so its loads
  run along N, coalesced, and each packed byte is loaded once. The unpack is register work: each
  word repeated into its 8 columns (three tl.interleave) and one shift by 4 * (n % 8).
- Scales and zeros [num_groups, N]: a tile inside one group reads one contiguous row of each.
- Zeros as uint8, not packed: GPTQ v1 zero points reach 16 (stored minus one), five bits. At
  group 128 they add 1/64 of the weight's bytes; (zero * scale) precomputed in 16 bits would add
  twice that and round where (q - zero) * scale in fp32 is exact.
- Act-order (GPTQ desc_act, compressed-tensors actorder): a g_idx that is not sorted has each
  group's columns scattered over K. The columns are sorted by group at load (stable), so each
  group is a run again and a tile reads one scale row; x's columns are gathered by the same
  permutation when the kernel loads them (small M) or by one index_select (large M). A weight
  whose sorted groups are runs of exactly group_size (a whole act-order checkpoint linear) then
  runs as a plain grouped one. A tensor-parallel slice of its input columns (row-parallel,
  narrow_in) keeps some columns of every group: runs of uneven lengths, so `groups` is kept and
  the kernel reads each column's group (a gather of scales per element: slower, exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchrun.quant.weights import Int4Weight

PACK = 8  # 4-bit values per int32 word
SYMMETRIC_ZERO = 8
# the kernel's K tiles are at least this deep (tl.dot); groups of other sizes below the row's
# length are read per column (`groups`)
MIN_TILE_K = 16


@dataclass
class Int4Packed:
    qweight: torch.Tensor  # int32 [K, N / 8]
    scales: torch.Tensor  # [num_groups, N]
    zeros: torch.Tensor | None  # uint8 [num_groups, N]; None: all SYMMETRIC_ZERO
    group_size: int  # at least K: one group per row
    perm: torch.Tensor | None = None  # int64 [K]
    groups: torch.Tensor | None = None  # int32 [K]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1] * PACK

    def column_groups(self) -> torch.Tensor:
        """The group of each of the kernel's columns, int64 [K]."""
        if self.groups is not None:
            return self.groups.long()
        return torch.arange(self.in_features, device=self.qweight.device) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] in x's column order (the permutation undone), computed in fp32."""
        q = unpack_words(self.qweight).float()  # [K, N]
        g = self.column_groups()
        z = SYMMETRIC_ZERO if self.zeros is None else self.zeros.float()[g]
        w = ((q - z) * self.scales.float()[g]).t()  # [N, K], kernel column order
        if self.perm is None:
            return w.to(dtype)
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out.to(dtype)


def pack_words(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values 0..15 -> int32 [K, N / 8]: word (k, c) holds q[8c + j, k] in bits
    [4j, 4j + 4)."""
    n, k = q.shape
    nibbles = q.t().reshape(k, n // PACK, PACK).long()  # [K, N / 8, 8]
    shifts = torch.arange(PACK, device=q.device) * 4
    words = (nibbles << shifts).sum(-1)  # [K, N / 8], 0 .. 2^32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """pack_words' inverse, as [K, N] uint8."""
    k, nw = words.shape
    shifts = torch.arange(PACK, device=words.device) * 4
    q = (words.long()[..., None] >> shifts) & 0xF  # [K, N / 8, 8]
    return q.reshape(k, nw * PACK).to(torch.uint8)


def can_pack(out_features: int) -> bool:
    """Whether a weight of `out_features` rows packs (whole words of output columns)."""
    return out_features % PACK == 0


def pack_int4(w: Int4Weight) -> Int4Packed:
    """w in the kernel's layout (module docstring), on w's device."""
    n, k = w.qweight.shape
    if not can_pack(n):
        raise ValueError(f"INT4 kernel layout: {n} output rows, not a multiple of {PACK}")
    q, g, perm = w.qweight, w.groups(), None
    if w.g_idx is not None:
        order = torch.argsort(g, stable=True)
        if not torch.equal(order, torch.arange(k, device=order.device)):
            perm, q, g = order, q[:, order], g[order]
    group_size = w.group_size
    per_column = w.g_idx is not None and not torch.equal(
        g, torch.arange(k, device=g.device) // group_size
    )
    if group_size < k and group_size % MIN_TILE_K:  # a K tile would straddle two groups
        per_column = True
    zeros = w.zeros.t().contiguous()
    if bool((zeros == SYMMETRIC_ZERO).all()):
        zeros = None
    return Int4Packed(
        qweight=pack_words(q),
        scales=w.scales.t().contiguous(),
        zeros=zeros,
        group_size=group_size,
        perm=perm,
        groups=g.to(torch.int32).contiguous() if per_column else None,
    )


# mma_pack: the decode layout of kernels/int4_gemv_mma.py (mma.m16n8k16's A operand)
MMA_ROWS = 16  # output rows an MMA (a warp)
MMA_K = 64  # K rows a step: four 16-deep k-blocks, one 16-byte load a thread


@dataclass
class Int4MmaPacked:
    """An Int4Packed's weight in the order of kernels/int4_gemv_mma.py, its scales and zeros
    shared (the same tensors, [num_groups, N]).

        qweight int32 [K / 64, N / 2, 4, 4]: word (s, r', m, b), nibble p (bits [4p, 4p + 4))
        holds q[n, k] with n = 16 (r' // 8) + 8 (p % 2) + r' % 8 and
        k = 64 s + 16 m + 4 b + 2 ((p // 2) % 2) + p // 4

    A warp's thread (r' % 8 = lane // 4, m = lane % 4) loads the 16 contiguous bytes (s, r', m,
    :): its mma.m16n8k16 A fragments (rows n and n + 8) of the step's four 16-deep blocks, and
    a warp's 32 loads are 512 contiguous bytes. Nibbles p and p + 4 are the two columns of one
    fragment register. The MMA's column c = 16 b + 8 b_8 + 2 m + b_1 of a step is K row
    64 s + 16 m + 4 b + 2 b_8 + b_1 (a permutation inside the step, the same for x): the B
    fragments of thread m are then x's 16 contiguous values 64 s + 16 m .. + 15 (two 16-byte
    loads a row of x)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * MMA_K

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1] * 2


def can_mma_pack(w: Int4Packed) -> bool:
    """Whether w takes mma_pack: no act-order, whole 16-row MMAs and 64-deep steps, groups of
    whole steps (or one group a row)."""
    k, n = w.in_features, w.out_features
    groups_ok = w.group_size >= k or w.group_size % MMA_K == 0
    return (
        w.perm is None and w.groups is None and n % MMA_ROWS == 0 and k % MMA_K == 0 and groups_ok
    )


def mma_pack(w: Int4Packed) -> Int4MmaPacked:
    """w's words in Int4MmaPacked's order (pure torch, on w's device)."""
    if not can_mma_pack(w):
        raise ValueError(
            f"INT4 MMA layout: needs no act-order, output rows a multiple of {MMA_ROWS}, input "
            f"rows of {MMA_K} and groups of whole {MMA_K}-row steps; got {w.out_features} x "
            f"{w.in_features}, group {w.group_size}, act-order {w.perm is not None}"
        )
    k, n = w.in_features, w.out_features
    q = unpack_words(w.qweight).long()  # [K, N]
    # k = 64 s + 16 m + 4 b + 2 b_k8 + b_k1, n = 16 R + 8 b_r8 + r
    q = q.reshape(k // MMA_K, 4, 4, 2, 2, n // MMA_ROWS, 2, 8)  # s m b b_k8 b_k1 R b_r8 r
    q = q.permute(0, 5, 7, 1, 2, 4, 3, 6)  # s R r m b | b_k1 b_k8 b_r8: p = 4 b_k1 + 2 b_k8 + b_r8
    q = q.reshape(k // MMA_K, n // 2, 4, 4, PACK)
    words = (q << (torch.arange(PACK, device=q.device) * 4)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()
    return Int4MmaPacked(words, w.scales, w.zeros, w.group_size)


def mma_unpack(w: Int4MmaPacked) -> torch.Tensor:
    """mma_pack's inverse, uint8 [K, N], from Int4MmaPacked's index map (the one
    kernels/int4_gemv_mma.py's joins and permutes read)."""
    s_n, pairs = w.qweight.shape[:2]
    q = (w.qweight.long()[..., None] >> (torch.arange(PACK, device=w.qweight.device) * 4)) & 0xF
    q = q.reshape(s_n, pairs // 8, 8, 4, 4, 2, 2, 2)  # s R r m b b_k1 b_k8 b_r8
    q = q.permute(0, 3, 4, 6, 5, 1, 7, 2)  # s m b b_k8 b_k1 R b_r8 r
    return q.reshape(s_n * MMA_K, pairs * 2).to(torch.uint8)
