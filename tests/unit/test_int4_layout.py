"""batchrun/quant/int4_layout.py: the INT4 kernel's weight layout, made from what every checkpoint
format decodes (AWQ, GPTQ sym / asym with and without act-order, compressed-tensors W4A16, at
each group size), stands for the same weight: the packing order, the act-order permutation and
its tensor-parallel slices round-trip exactly. Pure torch (no Triton); the kernel itself runs in
test_int4_kernel_interpreter.py and tests/gpu/test_int4_kernel_gpu.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quant_checkpoints_int4 import (  # noqa: E402
    int4_quantization_config,
    int4_tensors,
    quantize_int4,
    reference_g_idx,
)

from batchrun.quant.formats import awq, compressed_tensors_int4, gptq  # noqa: E402
from batchrun.quant.int4_layout import (  # noqa: E402
    Int4Packed,
    can_mma_pack,
    mma_pack,
    mma_unpack,
    pack_int4,
    pack_words,
    unpack_words,
)
from batchrun.quant.weights import Int4Weight  # noqa: E402

PARSE = {"awq": awq.parse, "gptq": gptq.parse, "pack-quantized": compressed_tensors_int4.parse}
OUT, IN = 64, 256
# (format, group size, symmetric, act-order), as the formats allow them
CASES = [
    ("awq", 32, False, False),
    ("awq", 128, False, False),
    ("awq", -1, False, False),
    ("gptq", 32, True, False),
    ("gptq", 64, False, True),
    ("gptq", 128, True, True),
    ("gptq", -1, False, True),
    ("pack-quantized", 32, True, False),
    ("pack-quantized", 64, False, False),
    ("pack-quantized", 128, True, True),
    ("pack-quantized", -1, False, False),
]


def decoded(fmt: str, group_size: int, symmetric: bool, act_order: bool) -> Int4Weight:
    """A random weight quantized by the tests' reference quantizer, saved in `fmt`'s on-disk
    layout and decoded by batchrun's format module."""
    w = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(1)) * 0.05
    g_idx = reference_g_idx(IN, group_size, act_order, seed=2)
    ref = quantize_int4(w, group_size, symmetric, torch.float16, g_idx)
    scheme = PARSE[fmt](int4_quantization_config(fmt, group_size, symmetric, act_order), "test")
    tensors = int4_tensors(fmt, ref, act_order=act_order)
    return scheme.decode(tensors, OUT, IN, "model.layers.0.mlp.down_proj")


def test_a_word_holds_eight_output_columns_lowest_bits_first():
    q = torch.arange(16, dtype=torch.uint8).reshape(16, 1).repeat(1, 3)  # [N=16, K=3]
    q[:, 1] = 15 - q[:, 1]
    words = pack_words(q)
    assert words.shape == (3, 2) and words.dtype == torch.int32
    for k in range(3):
        for c in range(2):
            word = int(words[k, c]) & 0xFFFFFFFF
            assert [(word >> (4 * j)) & 0xF for j in range(8)] == q[8 * c : 8 * c + 8, k].tolist()
    assert int(words[1, 0]) < 0  # 15 in the top nibble: the sign bit of the int32
    assert torch.equal(unpack_words(words), q.t())


@pytest.mark.parametrize("fmt,group_size,symmetric,act_order", CASES)
def test_the_layout_stands_for_the_decoded_weight(fmt, group_size, symmetric, act_order):
    w = decoded(fmt, group_size, symmetric, act_order)
    packed = pack_int4(w)
    assert packed.qweight.shape == (IN, OUT // 8) and packed.qweight.is_contiguous()
    assert packed.scales.shape == (w.scales.shape[1], OUT)
    assert torch.equal(packed.dequantize(), w.dequantize())
    # symmetric formats keep no zero points (8 each); the others keep theirs as stored
    assert (packed.zeros is None) == symmetric
    if act_order and group_size != -1:  # (one group per row: nothing to order)
        # the columns sorted by group: whole groups of group_size again, x gathered by perm
        assert packed.perm is not None and packed.groups is None
        g = w.groups()[packed.perm]
        assert bool((g[1:] >= g[:-1]).all())
        assert torch.equal(packed.column_groups(), g)
        assert torch.equal(unpack_words(packed.qweight), w.qweight[:, packed.perm].t())
    else:
        assert packed.perm is None and packed.groups is None
        assert torch.equal(unpack_words(packed.qweight), w.qweight.t())


def test_x_gathered_by_perm_times_the_sorted_weight_is_x_times_the_weight():
    w = decoded("gptq", 32, False, True)
    packed = pack_int4(w)
    x = torch.randn(3, IN, dtype=torch.float64)
    sorted_w = Int4Packed(packed.qweight, packed.scales, packed.zeros, packed.group_size)
    y = x[:, packed.perm] @ sorted_w.dequantize(torch.float64).t()
    torch.testing.assert_close(y, x @ w.dequantize(torch.float64).t())


@pytest.mark.parametrize("fmt,group_size,symmetric,act_order", CASES)
def test_tensor_parallel_slices_pack_to_their_part(fmt, group_size, symmetric, act_order):
    """Row-parallel (narrow_in: an act-order slice keeps some columns of every group, so each
    column's group is kept) and column-parallel (narrow_out, cat_out of the fused parts)."""
    w = decoded(fmt, group_size, symmetric, act_order)
    full = w.dequantize()
    for rank in range(2):
        part = w.narrow_in(rank * IN // 2, IN // 2)
        packed = pack_int4(part)
        assert torch.equal(packed.dequantize(), full[:, rank * IN // 2 : (rank + 1) * IN // 2])
        assert (packed.groups is not None) == (act_order and group_size != -1)
        if packed.groups is not None:  # each column's group, sorted, indexes the whole scales
            assert packed.scales.shape[0] == w.scales.shape[1]
            assert bool((packed.groups[1:] >= packed.groups[:-1]).all())
    halves = [w.narrow_out(0, 24), w.narrow_out(24, 40)]
    packed = pack_int4(Int4Weight.cat_out(halves))
    assert torch.equal(packed.dequantize(), full)


def test_zero_points_of_16_survive():
    """GPTQ v1 stores each zero point minus one: 16 decodes from a stored 15 (five bits)."""
    q = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    zeros = torch.full((8, 2), 16, dtype=torch.uint8)
    w = Int4Weight(q, torch.rand(8, 2).half(), zeros, 32)
    packed = pack_int4(w)
    assert packed.zeros is not None and int(packed.zeros.max()) == 16
    assert torch.equal(packed.dequantize(), w.dequantize())


def test_groups_smaller_than_a_tile_are_read_per_column():
    q = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    w = Int4Weight(q, torch.rand(8, 8).half(), torch.full((8, 8), 8, dtype=torch.uint8), 8)
    packed = pack_int4(w)
    assert packed.groups is not None and packed.perm is None
    assert torch.equal(packed.dequantize(), w.dequantize())


def test_output_rows_that_fill_no_word_are_refused():
    q = torch.zeros(12, 32, dtype=torch.uint8)
    w = Int4Weight(q, torch.ones(12, 1).half(), torch.full((12, 1), 8, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="12 output rows, not a multiple of 8"):
        pack_int4(w)


def test_mma_layout_holds_each_value_where_its_index_map_says():
    """mma_pack (kernels/int4_gemv_mma.py's layout): word (s, r', m, b), nibble p holds
    q[16 (r' // 8) + 8 (p % 2) + r' % 8, 64 s + 16 m + 4 b + 2 ((p // 2) % 2) + p // 4], every
    one of them; mma_unpack inverts it; the scales and zeros are the packed weight's own."""
    n, k = 96, 256
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    zeros = torch.randint(0, 16, (2, n), dtype=torch.uint8)
    packed = Int4Packed(pack_words(q), torch.rand(2, n).half(), zeros, 128)
    w = mma_pack(packed)
    assert w.qweight.shape == (k // 64, n // 2, 4, 4) and w.qweight.dtype == torch.int32
    assert (w.in_features, w.out_features) == (k, n)
    assert w.scales is packed.scales and w.zeros is packed.zeros and w.group_size == 128
    s, rp, m, b, p = torch.meshgrid(*(torch.arange(d) for d in (k // 64, n // 2, 4, 4, 8)),
                                    indexing="ij")  # fmt: skip
    rows = 16 * (rp // 8) + 8 * (p % 2) + rp % 8
    cols = 64 * s + 16 * m + 4 * b + 2 * ((p // 2) % 2) + p // 4
    nibbles = (w.qweight.long()[..., None] >> (4 * torch.arange(8))) & 0xF
    assert torch.equal(nibbles, q.long()[rows, cols])
    assert torch.equal(mma_unpack(w), q.t())


def test_mma_layout_takes_plain_weights_of_whole_steps_only():
    """No act-order, rows in 16s, K in 64s, groups of whole 64-row steps or one group a row:
    anything else is refused with the shape it got."""
    for case in CASES:
        packed = pack_int4(decoded(*case))  # 64 x 256
        # (act-order with one group a row needs no permutation)
        ok = case[1] == -1 or (not case[3] and case[1] % 64 == 0)
        assert can_mma_pack(packed) == ok, case
        if not ok:
            with pytest.raises(ValueError, match="INT4 MMA layout"):
                mma_pack(packed)
    narrow = Int4Packed(torch.zeros(256, 1, dtype=torch.int32), torch.ones(2, 8), None, 128)
    assert not can_mma_pack(narrow)  # 8 output rows
