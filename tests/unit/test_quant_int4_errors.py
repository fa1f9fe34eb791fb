"""INT4 formats, bad input: a quantization_config batchrun does not read names the field, the
value and what is supported (ModelConfigError); a tensor that does not match its format names
the tensor, its shape and the shape expected (WeightLoadError). And which modules each format's
config leaves unquantized."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from batchrun.errors import ModelConfigError, WeightLoadError
from batchrun.quant.formats import awq, compressed_tensors_int4, gptq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quant_checkpoints_int4 import (  # noqa: E402
    int4_quantization_config,
    int4_tensors,
    quantize_int4,
    reference_g_idx,
)

PARSERS = {"awq": awq.parse, "gptq": gptq.parse, "pack-quantized": compressed_tensors_int4.parse}
SRC = "/models/x/config.json"
WHERE = "model.layers.2.self_attn.o_proj"


def _config(fmt: str, **changes) -> dict:
    qcfg = int4_quantization_config(fmt, 128, True)
    if fmt == "pack-quantized":
        qcfg["config_groups"]["group_0"]["weights"].update(changes)
    else:
        qcfg.update(changes)
    return qcfg


def _refused(fmt: str, *needles: str, **changes) -> str:
    with pytest.raises(ModelConfigError) as e:
        PARSERS[fmt](_config(fmt, **changes), SRC)
    msg = str(e.value)
    assert msg.startswith(SRC), msg
    for needle in needles:
        assert needle in msg, msg
    return msg


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_bits_3(fmt):
    _refused(fmt, "quantization_config.bits 3 is not supported", "supported: 4", bits=3)


def test_bits_3_pack_quantized():
    _refused(
        "pack-quantized",
        "quantization_config.config_groups.group_0.weights.num_bits 3 is not supported",
        "supported: 4",
        num_bits=3,
    )


@pytest.mark.parametrize("fmt", ["awq", "gptq", "pack-quantized"])
@pytest.mark.parametrize("size", [16, 256, 96, 0])
def test_unsupported_group_size(fmt, size):
    _refused(fmt, f"group_size {size} is not supported", "supported: 32, 64, 128", group_size=size)


def test_group_strategy_needs_a_group_size():
    qcfg = _config("pack-quantized")
    del qcfg["config_groups"]["group_0"]["weights"]["group_size"]
    with pytest.raises(ModelConfigError, match="lacks config_groups.group_0.weights.group_size"):
        compressed_tensors_int4.parse(qcfg, SRC)


def test_per_row_groups_are_read():
    assert awq.parse(_config("awq", group_size=-1), SRC).group_size == -1
    assert gptq.parse(_config("gptq", group_size=-1), SRC).group_size == -1
    qcfg = int4_quantization_config("pack-quantized", -1, True)
    assert compressed_tensors_int4.parse(qcfg, SRC).group_size == -1


@pytest.mark.parametrize("version", ["gemv", "GEMV_FAST", "marlin", "exllama", "ipex"])
def test_awq_other_layouts(version):
    _refused("awq", f"version {version!r} is not supported", "supported: gemm", version=version)


def test_awq_spellings():
    """GEMM in capitals, GPTQModel's `format`, AutoAWQ's w_bit / q_group_size."""
    qcfg = {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "version": "GEMM"}
    assert awq.parse(qcfg, SRC) == awq.AwqScheme(64, True)
    qcfg = {"quant_method": "awq", "bits": 4, "group_size": 128, "format": "gemm"}
    assert awq.parse(qcfg, SRC).group_size == 128
    _refused("awq", "format 'gemv' is not supported", format="gemv", version=None)
    _refused("awq", "backend 'llm-awq' is not supported", backend="llm-awq")
    assert awq.parse(_config("awq", backend="marlin"), SRC).group_size == 128


def test_awq_zero_point_false_reads_qzeros():
    assert awq.parse(_config("awq", zero_point=False), SRC).zero_point is False
    _refused("awq", "zero_point 1 is not supported", "supported: true, false", zero_point=1)


@pytest.mark.parametrize("fmt", ["marlin", "bitblas", "gptq_v3"])
def test_gptq_other_checkpoint_formats(fmt):
    _refused(
        "gptq",
        f"checkpoint_format {fmt!r} is not",
        "supported: gptq, gptq_v2",
        checkpoint_format=fmt,
    )


def test_gptq_other_fields():
    _refused("gptq", "desc_act 'yes' is not supported", desc_act="yes")
    _refused("gptq", "is_marlin_format True is not supported", is_marlin_format=True)
    _refused("gptq", "lm_head True is not supported", lm_head=True)
    _refused("gptq", "pack_dtype 'int16' is not supported", pack_dtype="int16")
    _refused("gptq", "dynamic[", "group_size", dynamic={r"+:.*down_proj": {"group_size": 32}})
    with pytest.raises(ModelConfigError, match="quant_method 'awq' is not supported"):
        gptq.parse({**_config("gptq"), "quant_method": "awq"}, SRC)


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"type": "float"}, "weights.type 'float' is not supported"),
        ({"strategy": "tensor"}, "weights.strategy 'tensor' is not supported"),
        ({"strategy": "block", "block_structure": [128, 128]}, "block_structure [128, 128] is not"),
        ({"dynamic": True}, "weights.dynamic True is not supported"),
        ({"actorder": "sideways"}, "weights.actorder 'sideways' is not supported"),
    ],
)
def test_pack_quantized_weight_args(changes, needle):
    _refused("pack-quantized", needle, **changes)


def test_pack_quantized_config():
    base = int4_quantization_config("pack-quantized", 128, True)
    bad = [
        ({"format": "float-quantized"}, "format 'float-quantized' is not supported"),
        ({"quantization_status": "frozen"}, "quantization_status 'frozen' is not supported"),
        ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config.format"),
        ({"transform_config": {"config_groups": {}}}, "transform_config"),
        ({"config_groups": {}}, "config_groups is {}"),
        ({"config_groups": {"W4A16": ["Linear"]}}, "config_groups.W4A16 is"),
        ({"ignore": "lm_head"}, "ignore must be a list"),
    ]
    for changes, needle in bad:
        with pytest.raises(ModelConfigError, match=needle.replace("[", r"\[")):
            compressed_tensors_int4.parse({**base, **changes}, SRC)
    mixed = copy.deepcopy(base)
    mixed["format"] = "mixed-precision"
    assert compressed_tensors_int4.parse(mixed, SRC).group_size == 128
    del mixed["config_groups"]["group_0"]["format"]
    with pytest.raises(ModelConfigError, match="lacks config_groups.group_0.format"):
        compressed_tensors_int4.parse(mixed, SRC)
    acts = copy.deepcopy(base)
    acts["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "float"}
    with pytest.raises(ModelConfigError, match="group_0.input_activations .* is not supported"):
        compressed_tensors_int4.parse(acts, SRC)
    two = copy.deepcopy(base)
    two["config_groups"]["group_1"] = copy.deepcopy(two["config_groups"]["group_0"])
    two["config_groups"]["group_1"]["weights"]["group_size"] = 64
    with pytest.raises(ModelConfigError, match="different weight schemes"):
        compressed_tensors_int4.parse(two, SRC)
    two["config_groups"]["group_1"]["weights"]["group_size"] = 128
    two["config_groups"]["group_1"]["targets"] = ["re:.*mlp.*"]
    assert compressed_tensors_int4.parse(two, SRC).targets.patterns == ("Linear", "re:.*mlp.*")


def _tensors(fmt, out_features=32, in_features=256, symmetric=False, act_order=False):
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))
    dtype = torch.bfloat16 if fmt == "pack-quantized" else torch.float16
    g_idx = reference_g_idx(in_features, 128, act_order)
    ref = quantize_int4(w, 128, symmetric, dtype, g_idx)
    qcfg = int4_quantization_config(fmt, 128, symmetric, act_order)
    return PARSERS[fmt](qcfg, SRC), int4_tensors(fmt, ref, act_order=act_order)


@pytest.mark.parametrize(
    "fmt,name", [("awq", "scales"), ("gptq", "scales"), ("pack-quantized", "weight_scale")]
)
def test_missing_scale(fmt, name):
    scheme, tensors = _tensors(fmt)
    del tensors[name]
    with pytest.raises(WeightLoadError, match=rf"the checkpoint lacks {WHERE}\.{name}, which"):
        scheme.decode(tensors, 32, 256, WHERE)


@pytest.mark.parametrize(
    "fmt,name,bad,expected",
    [
        ("awq", "scales", (1, 32), "(2, 32)"),
        ("awq", "qweight", (256, 8), "(256, 4)"),
        ("awq", "qzeros", (2, 32), "(2, 4)"),
        ("gptq", "qweight", (256, 32), "(32, 32)"),
        ("gptq", "scales", (32, 2), "(2, 32)"),
        ("gptq", "g_idx", (128,), "(256,)"),
        ("pack-quantized", "weight_scale", (32, 1), "(32, 2)"),
        ("pack-quantized", "weight_packed", (32, 64), "(32, 32)"),
        ("pack-quantized", "weight_zero_point", (32, 2), "(4, 2)"),
    ],
)
def test_wrong_shape(fmt, name, bad, expected):
    scheme, tensors = _tensors(fmt)
    tensors[name] = torch.zeros(bad, dtype=tensors[name].dtype)
    with pytest.raises(WeightLoadError) as e:
        scheme.decode(tensors, 32, 256, WHERE)
    msg = str(e.value)
    assert f"{WHERE}.{name} has shape {bad}" in msg, msg
    assert f"expects shape {expected}" in msg, msg


def test_wrong_dtype():
    scheme, tensors = _tensors("awq")
    tensors["qweight"] = tensors["qweight"].long()
    with pytest.raises(
        WeightLoadError, match=r"has shape \(256, 4\) int64; .* expects shape \(256, 4\) int32"
    ):
        scheme.decode(tensors, 32, 256, WHERE)
    scheme, tensors = _tensors("gptq")
    tensors["scales"] = tensors["scales"].to(torch.int16)
    with pytest.raises(WeightLoadError, match="int16; .* float32/bfloat16/float16"):
        scheme.decode(tensors, 32, 256, WHERE)


def test_size_from_config_json_does_not_fit():
    """The config's in_features is not a multiple of the group size / of 8."""
    scheme, tensors = _tensors("awq")
    with pytest.raises(WeightLoadError, match="in_features 200 is not a multiple of 128"):
        scheme.decode(tensors, 32, 200, WHERE)
    scheme, tensors = _tensors("gptq")
    with pytest.raises(WeightLoadError, match="in_features 252 is not a multiple of 8"):
        scheme.decode(tensors, 32, 252, WHERE)
    with pytest.raises(WeightLoadError, match="out_features 36 is not a multiple of 8"):
        awq.parse(_config("awq"), SRC).decode(tensors, 36, 256, WHERE)


def test_act_order_needs_g_idx_in_range():
    scheme, tensors = _tensors("gptq", act_order=True)
    good = tensors.pop("g_idx")
    with pytest.raises(WeightLoadError, match=r"lacks model\.layers\.2\.self_attn\.o_proj\.g_idx"):
        scheme.decode(tensors, 32, 256, WHERE)
    tensors["g_idx"] = good.clone()
    tensors["g_idx"][7] = 2
    with pytest.raises(WeightLoadError, match="groups from 0 to 2; expected groups 0 to 1"):
        scheme.decode(tensors, 32, 256, WHERE)
    scheme, tensors = _tensors("pack-quantized", act_order=True)
    del tensors["weight_g_idx"]
    with pytest.raises(WeightLoadError, match=r"lacks .*o_proj\.weight_g_idx"):
        scheme.decode(tensors, 32, 256, WHERE)


def test_weight_shape_must_match():
    scheme, tensors = _tensors("pack-quantized")
    tensors["weight_shape"] = torch.tensor([32, 248])
    with pytest.raises(WeightLoadError, match=r"weight_shape holds \(32, 248\); expected"):
        scheme.decode(tensors, 32, 256, WHERE)


def test_awq_modules_to_not_convert():
    scheme = awq.parse(_config("awq", modules_to_not_convert=["mlp.down_proj", "layers.1."]), SRC)
    assert scheme.is_quantized("model.layers.0.self_attn.q_proj")
    assert not scheme.is_quantized("model.layers.0.mlp.down_proj")
    assert not scheme.is_quantized("model.layers.1.self_attn.q_proj")
    assert not scheme.is_quantized("lm_head")


def test_gptq_unquantized_modules():
    dynamic = {r"-:model\.layers\.1\..*": {}, r"+:.*q_proj": {"group_size": 128, "bits": 4}}
    scheme = gptq.parse(_config("gptq", dynamic=dynamic), SRC)
    assert scheme.is_quantized("model.layers.0.self_attn.q_proj")
    assert not scheme.is_quantized("model.layers.1.self_attn.q_proj")
    assert not scheme.is_quantized("lm_head")
    block = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["mlp.down_proj"]]
    scheme = gptq.parse(_config("gptq", modules_in_block_to_quantize=block), SRC)
    assert scheme.is_quantized("model.layers.3.self_attn.k_proj")
    assert scheme.is_quantized("model.layers.3.mlp.down_proj")
    assert not scheme.is_quantized("model.layers.3.mlp.up_proj")


def test_pack_quantized_targets_and_ignore():
    qcfg = int4_quantization_config("pack-quantized", 128, True)
    qcfg["ignore"] = ["lm_head", "re:.*layers\\.0\\.mlp\\..*", "model.layers.2.self_attn.o_proj"]
    scheme = compressed_tensors_int4.parse(qcfg, SRC)
    assert scheme.is_quantized("model.layers.1.mlp.up_proj")
    assert not scheme.is_quantized("model.layers.0.mlp.up_proj")
    assert not scheme.is_quantized("model.layers.2.self_attn.o_proj")
    assert scheme.is_quantized("model.layers.12.self_attn.o_proj")
    assert not scheme.is_quantized("lm_head")
    qcfg["config_groups"]["group_0"]["targets"] = ["re:.*self_attn.*"]
    qcfg["ignore"] = []
    scheme = compressed_tensors_int4.parse(qcfg, SRC)
    assert scheme.is_quantized("model.layers.1.self_attn.v_proj")
    assert not scheme.is_quantized("model.layers.1.mlp.gate_proj")
