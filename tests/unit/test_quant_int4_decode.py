"""INT4 formats (AWQ, GPTQ, compressed-tensors pack-quantized): the packing orders round trip
through the test's reference packers, and each decoder gives back exactly the integers, zero
points and scales the reference quantizer made (so the same dequantized weights), whole and
sliced for tensor parallelism."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from batchrun.quant.formats import awq, compressed_tensors_int4, gptq
from batchrun.quant.formats.int4_common import unpack_int4
from batchrun.quant.weights import Int4Weight

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quant_checkpoints_int4 import (  # noqa: E402
    int4_quantization_config,
    int4_tensors,
    pack_awq,
    pack_columns,
    pack_rows,
    quantize_int4,
    reference_g_idx,
)

PARSERS = {"awq": awq.parse, "gptq": gptq.parse, "pack-quantized": compressed_tensors_int4.parse}
WHERE = "model.layers.0.mlp.down_proj"


def _values(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 16, (rows, cols), generator=torch.Generator().manual_seed(seed))


def test_awq_interleave_by_hand():
    """Columns 0..7 holding the values 0..7 pack into 0x75316420: nibble i holds column
    [0, 2, 4, 6, 1, 3, 5, 7][i]; read back, column j sits at bit 4 * [0, 4, 1, 5, 2, 6, 3, 7][j]
    (the shifts 0, 16, 4, 20, 8, 24, 12, 28 of AWQ's GEMM kernel)."""
    values = torch.arange(8).reshape(1, 8)
    word = pack_awq(values)
    assert word.item() == 0x75316420
    shifts = [4 * awq.AWQ_REVERSE_ORDER[j] for j in range(8)]
    assert shifts == [0, 16, 4, 20, 8, 24, 12, 28]
    assert [(word.item() >> s) & 0xF for s in shifts] == list(range(8))
    assert awq.unpack_awq(word).tolist() == [list(range(8))]


def test_awq_packing_round_trip():
    values = _values(24, 64)
    assert torch.equal(awq.unpack_awq(pack_awq(values)).long(), values)


def test_gptq_row_packing_by_hand_and_round_trip():
    """GPTQ's qweight packs 8 input rows a word: rows 0..7 of a column holding 1..8 make
    0x87654321; a word whose top nibble is set is a negative int32."""
    values = torch.arange(1, 9).reshape(8, 1)
    assert pack_rows(values).item() == 0x87654321 - 2**32
    values = _values(64, 40, seed=1)
    unpacked = unpack_int4(pack_rows(values)).transpose(1, 2).reshape(64, 40)
    assert torch.equal(unpacked.long(), values)


def test_column_packing_by_hand_and_round_trip():
    """GPTQ's qzeros and compressed-tensors' weight_packed: column 8c + i in nibble i, a ragged
    last word padded with zeros."""
    values = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    packed = pack_columns(values)
    assert packed.tolist() == [[0x87654321 - 2**32, 0xA9]]
    values = _values(8, 44, seed=2)
    assert torch.equal(unpack_int4(pack_columns(values)).flatten(-2)[:, :44].long(), values)


def test_pack_quantized_packing_is_compressed_tensors():
    """The test's packer writes what compressed-tensors 0.20.1 writes (its values are signed,
    stored plus 8), along either dimension."""
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    values = _values(12, 44, seed=3)
    signed = (values - 8).to(torch.int8)
    assert torch.equal(ct.pack_to_int32(signed, 4), pack_columns(values))
    by_rows = ct.pack_to_int32(signed, 4, packed_dim=0)
    assert torch.equal(by_rows, pack_columns(values.t()).t())


def _case(fmt, out_features, in_features, group_size, symmetric, act_order, v2=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    dtype = torch.bfloat16 if fmt == "pack-quantized" else torch.float16
    g_idx = reference_g_idx(in_features, group_size, act_order, seed=seed)
    ref = quantize_int4(w, group_size, symmetric, dtype, g_idx)
    qcfg = int4_quantization_config(fmt, group_size, symmetric, act_order, v2)
    scheme = PARSERS[fmt](qcfg, "config.json")
    return ref, scheme, int4_tensors(fmt, ref, v2, act_order)


CASES = [
    # fmt, group size, symmetric, act-order, GPTQ v2
    ("awq", 128, False, False, False),
    ("awq", 32, True, False, False),
    ("awq", -1, False, False, False),
    ("gptq", 128, True, False, False),
    ("gptq", 128, False, False, False),
    ("gptq", 64, False, True, False),
    ("gptq", 32, True, True, False),
    ("gptq", 128, False, False, True),
    ("gptq", -1, False, True, True),
    ("pack-quantized", 128, True, False, False),
    ("pack-quantized", 32, False, False, False),
    ("pack-quantized", -1, False, False, False),
    ("pack-quantized", 64, True, True, False),
]


@pytest.mark.parametrize("fmt,group_size,symmetric,act_order,v2", CASES)
def test_decode_gives_the_reference_back(fmt, group_size, symmetric, act_order, v2):
    out_features, in_features = 48, 256
    ref, scheme, tensors = _case(
        fmt, out_features, in_features, group_size, symmetric, act_order, v2
    )
    assert scheme.family == "int4"
    assert set(scheme.tensor_names) <= set(tensors)
    assert set(tensors) <= set(scheme.tensor_names) | set(scheme.optional_names)
    w = scheme.decode(tensors, out_features, in_features, WHERE)
    assert isinstance(w, Int4Weight)
    assert w.qweight.dtype == torch.uint8 and w.zeros.dtype == torch.uint8
    assert torch.equal(w.qweight.long(), ref.q)
    assert torch.equal(w.groups(), ref.g_idx)
    g = w.groups()
    assert torch.equal(w.zeros.long()[:, g], ref.zeros[:, g])
    assert w.scales.dtype == ref.scales.dtype
    assert torch.equal(w.scales[:, g], ref.scales[:, g])
    assert torch.equal(w.dequantize(), ref.dequantize())
    # act-order keeps its g_idx; columns in order (or all in one group) need none, and TP
    # then slices by group
    assert (w.g_idx is not None) == (act_order and group_size != -1)


@pytest.mark.parametrize("fmt,group_size,symmetric,act_order,v2", CASES)
def test_tensor_parallel_slices(fmt, group_size, symmetric, act_order, v2):
    """Rank 1 of 2 of a column-parallel (out rows) and a row-parallel (in columns) linear."""
    ref, scheme, tensors = _case(fmt, 48, 256, group_size, symmetric, act_order, v2, seed=5)
    w = scheme.decode(tensors, 48, 256, WHERE)
    full = ref.dequantize()
    assert torch.equal(w.narrow_out(24, 24).dequantize(), full[24:])
    assert torch.equal(w.narrow_in(128, 128).dequantize(), full[:, 128:])
    fused = Int4Weight.cat_out([w.narrow_out(0, 8), w.narrow_out(8, 40)])
    assert torch.equal(fused.dequantize(), full)


def test_per_row_scales_slice_anywhere():
    """One group per row (group size -1): a tensor-parallel slice of the input columns keeps the
    row's scale, wherever it starts."""
    ref, scheme, tensors = _case("gptq", 16, 96, -1, False, False)
    w = scheme.decode(tensors, 16, 96, WHERE)
    assert torch.equal(w.narrow_in(48, 48).dequantize(), ref.dequantize()[:, 48:])
    assert torch.equal(w.narrow_in(0, 40).dequantize(), ref.dequantize()[:, :40])


def test_pack_quantized_ragged_words():
    """in and out features that are not multiples of 8: weight_packed's last word and the zero
    points' last word are padded."""
    ref, scheme, tensors = _case("pack-quantized", 44, 96, 32, False, False)
    assert tensors["weight_packed"].shape == (44, 12)
    assert tensors["weight_zero_point"].shape == (6, 3)
    w = scheme.decode(tensors, 44, 96, WHERE)
    assert torch.equal(w.dequantize(), ref.dequantize())
    ref, scheme, tensors = _case("pack-quantized", 40, 100, -1, False, False, seed=1)
    assert tensors["weight_packed"].shape == (40, 13)
    assert torch.equal(scheme.decode(tensors, 40, 100, WHERE).dequantize(), ref.dequantize())


def test_gptq_v1_zero_minus_one():
    """A v1 checkpoint's qzeros hold z - 1 (7 for a symmetric scheme's 8); v2 holds z."""
    ref, scheme, tensors = _case("gptq", 16, 64, 32, True, False)
    assert (unpack_int4(tensors["qzeros"]) == 7).all()
    assert (scheme.decode(tensors, 16, 64, WHERE).zeros == 8).all()
    ref, scheme, tensors = _case("gptq", 16, 64, 32, True, False, v2=True)
    assert (unpack_int4(tensors["qzeros"]) == 8).all()
    assert (scheme.decode(tensors, 16, 64, WHERE).zeros == 8).all()


def test_gptq_sequential_g_idx_is_dropped_and_optional():
    """Without desc_act the g_idx AutoGPTQ saves (k // g) adds nothing, and a checkpoint
    without one decodes the same."""
    ref, scheme, tensors = _case("gptq", 16, 128, 32, False, False)
    assert scheme.decode(tensors, 16, 128, WHERE).g_idx is None
    del tensors["g_idx"]
    assert torch.equal(scheme.decode(tensors, 16, 128, WHERE).dequantize(), ref.dequantize())


def test_dummy_weights_have_the_schemes_shape():
    gen = torch.Generator().manual_seed(0)
    for fmt, group_size in (("awq", 128), ("gptq", -1), ("pack-quantized", 32)):
        scheme = PARSERS[fmt](int4_quantization_config(fmt, group_size, True), "config.json")
        w = scheme.dummy(64, 256, gen)
        groups = 1 if group_size == -1 else 256 // group_size
        assert w.qweight.shape == (64, 256) and w.scales.shape == (64, groups)
        assert w.zeros.shape == (64, groups) and w.g_idx is None
        assert 0.005 < w.dequantize().std() < 0.05


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, -1])
def test_pack_quantized_is_what_compressed_tensors_writes_and_reads(symmetric, group_size):
    """compressed-tensors 0.20.1's own compressor, given the reference's scales and zero points,
    writes the test's tensors bit for bit, and its decompressor reads them as batchrun does."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    ref, scheme, ours = _case("pack-quantized", 40, 128, group_size, symmetric, False, seed=7)
    args = QuantizationArgs(
        num_bits=4,
        type="int",
        symmetric=symmetric,
        strategy="channel" if group_size == -1 else "group",
        group_size=None if group_size == -1 else group_size,
    )
    ct_scheme = QuantizationScheme(targets=["Linear"], weights=args)
    state = {"weight": ref.dequantize(), "weight_scale": ref.scales}
    if not symmetric:
        state["weight_zero_point"] = (ref.zeros - 8).to(torch.int8)  # signed, as it keeps them
    theirs = PackedQuantizationCompressor.compress(state, ct_scheme)
    assert set(theirs) == set(ours)
    for name, tensor in theirs.items():
        assert torch.equal(tensor, ours[name]), name
    weight = PackedQuantizationCompressor.decompress(ours, ct_scheme)["weight"]
    decoded = scheme.decode(ours, 40, 128, WHERE).dequantize()
    # it dequantizes in the scales' dtype: one rounding of the exact product
    assert torch.equal(weight, decoded.to(weight.dtype))


def test_dequant_gemv_plans_int4_dense_and_runs_dense_off_the_gpu():
    """int4_matmul "dequant-gemv" plans an INT4 linear as "int4_dense" ("dequant" as "dense");
    off the GPU (no tensor-core GEMV) the layer keeps no packed copy and is the dense path."""
    from batchrun.quant.linear import QuantMatmul, plan_linear

    scheme = awq.parse(int4_quantization_config("awq", 32, False, False), "test")
    plans = {
        path: plan_linear(scheme, "dequant", torch.float32, (WHERE,), 64, 128, path).kernel
        for path in ("dequant", "dequant-gemv", "triton")
    }
    assert plans == {"dequant": "dense", "dequant-gemv": "int4_dense", "triton": "int4"}
    ref = quantize_int4(torch.randn(64, 128) * 0.05, 32, False, torch.float16, None)
    w = awq.parse(int4_quantization_config("awq", 32, False, False), "test").decode(
        int4_tensors("awq", ref), 64, 128, WHERE
    )
    layers = {}
    for path in ("dequant", "dequant-gemv"):
        spec = plan_linear(scheme, "dequant", torch.float32, (WHERE,), 64, 128, path)
        layers[path] = QuantMatmul(64, 128, spec, torch.float32, "cpu")
        layers[path].load(w, WHERE)
    hybrid = layers["dequant-gemv"]
    assert not hybrid.mma and hybrid.qweight is None and "dequantized" in hybrid.extra_repr()
    x = torch.randn(5, 128)
    assert not hybrid.takes_gemv(x)
    assert torch.equal(hybrid(x), layers["dequant"](x))
