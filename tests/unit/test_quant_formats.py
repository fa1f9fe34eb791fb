"""Quantization configs and the FP8 linear: config.json's quantization_config read into a scheme
(or refused naming the field and what is supported), FP8 tensors checked, the quantized
matmul's paths against the dequantized reference, and the kernel rules for quantized models."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quant_checkpoints import FP8_FORMATS, act_per_token, act_per_token_group  # noqa: E402
from quant_checkpoints import quantize_fp8 as reference_quantize  # noqa: E402

from batchrun.config import EngineConfig, KernelPlan  # noqa: E402
from batchrun.engine.kernel_choice import resolve_kernels  # noqa: E402
from batchrun.errors import ModelConfigError, WeightLoadError  # noqa: E402
from batchrun.quant import formats  # noqa: E402
from batchrun.quant.act_quant import quant_per_token  # noqa: E402
from batchrun.quant.formats import parse_quant_config  # noqa: E402
from batchrun.quant.formats.common import ModuleFilter  # noqa: E402
from batchrun.quant.linear import QuantMatmul, QuantSpec  # noqa: E402
from batchrun.quant.online import OnlineFp8Scheme  # noqa: E402
from batchrun.quant.quantize import quantize_fp8  # noqa: E402

SOURCE = "m/config.json"
Q = "model.layers.0.self_attn.q_proj"


def parse(qcfg: dict):
    return parse_quant_config({"quantization_config": qcfg}, SOURCE)


def config_of(fmt: str) -> dict:
    return FP8_FORMATS[fmt].config()


# -- configs -------------------------------------------------------------------------------------


def test_no_quantization_config_is_plain():
    assert parse_quant_config({"hidden_size": 8}, SOURCE) is None


@pytest.mark.parametrize(
    "fmt,weights,activations,block",
    [
        ("ct-fp8-channel", "channel", "dynamic", None),
        ("ct-fp8-tensor", "tensor", "static", None),
        ("ct-fp8-block", "block", "dynamic", (128, 128)),
        ("modelopt-fp8", "tensor", "static", None),
        ("fp8-block", "block", "dynamic", (128, 128)),
        ("fp8-tensor", "tensor", "static", None),
    ],
)
def test_each_fp8_format_parses(fmt, weights, activations, block):
    scheme = parse(config_of(fmt))
    assert (scheme.family, scheme.weights, scheme.activations, scheme.block) == (
        "fp8",
        weights,
        activations,
        block,
    )
    assert scheme.describe().startswith(f"fp8 ({scheme.method}, ")
    assert scheme.is_quantized(Q)
    if fmt != "fp8-block":  # Qwen3's -FP8 configs list no ignored modules
        assert not scheme.is_quantized("lm_head")


def test_ignore_lists_in_each_dialect():
    ct = ModuleFilter(("lm_head", r"re:.*layers\.1\.mlp\.down_proj$"), "compressed-tensors")
    assert ct.matches("model.layers.1.mlp.down_proj") and ct.matches("lm_head")
    assert not ct.matches("model.layers.11.mlp.down_proj") and not ct.matches(Q)
    glob = ModuleFilter(("lm_head", "model.layers.1.mlp*", "*.o_proj"), "glob")
    assert glob.matches("model.layers.1.mlp.up_proj") and glob.matches(
        "model.layers.3.self_attn.o_proj"
    )
    assert not glob.matches("model.layers.10.mlp.up_proj")
    assert not glob.matches(Q)
    sub = ModuleFilter(("lm_head",), "substring")
    assert sub.matches("lm_head") and not sub.matches(Q)
    targets = ModuleFilter(("Linear",), "compressed-tensors")
    assert targets.matches(Q)


def test_modelopt_nested_and_flat_configs():
    nested = {
        "quant_method": "modelopt",
        "quantization": {"quant_algo": "fp8", "exclude_modules": ["lm_head"]},
    }
    flat = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["model.layers.0.*"]}
    assert parse(nested).activations == "static"
    assert not parse(flat).is_quantized(Q)
    assert parse(flat).is_quantized("model.layers.1.self_attn.q_proj")


def test_an_unsupported_method_lists_every_format():
    with pytest.raises(ModelConfigError) as e:
        parse({"quant_method": "bitsandbytes", "load_in_4bit": True})
    msg = str(e.value)
    assert SOURCE in msg and "quant_method 'bitsandbytes'" in msg
    for name in (
        "compressed-tensors",
        "float-quantized",
        "pack-quantized",
        "modelopt",
        "fp8",
        "awq",
        "gptq",
    ):
        assert name in msg


@pytest.mark.parametrize(
    "edit,field,supported",
    [
        (lambda c: c.update(format="int-quantized"), "format 'int-quantized'", "pack-quantized"),
        (
            lambda c: c["config_groups"]["group_0"]["weights"].update(num_bits=4),
            "config_groups.group_0.weights.num_bits 4",
            "8",
        ),
        (
            lambda c: c["config_groups"]["group_0"]["weights"].update(
                strategy="group", group_size=64
            ),
            "config_groups.group_0.weights.strategy 'group'",
            "tensor, channel, block",
        ),
        (
            lambda c: c["config_groups"]["group_0"]["input_activations"].update(strategy="tensor"),
            "config_groups.group_0.input_activations",
            "strategy token with dynamic true",
        ),
        (
            lambda c: c["config_groups"]["group_0"]["weights"].update(symmetric=False),
            "weights.symmetric False",
            "true",
        ),
        (
            lambda c: c["config_groups"].update(
                group_1={**c["config_groups"]["group_0"], "input_activations": None}
            ),
            "config_groups group_0 and group_1 quantize differently",
            "one FP8 scheme",
        ),
    ],
)
def test_unsupported_compressed_tensors_settings_name_the_field(edit, field, supported):
    qcfg = copy.deepcopy(config_of("ct-fp8-channel"))
    edit(qcfg)
    with pytest.raises(ModelConfigError) as e:
        parse(qcfg)
    assert field in str(e.value) and supported in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "qcfg,field,supported",
    [
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quant_algo 'NVFP4'", "FP8"),
        (
            {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"},
            "kv_cache_quant_algo",
            "FP8",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [64, 64]},
            "weight_block_size [64, 64]",
            "[128, 128]",
        ),
        (
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
            "activation_scheme 'static'",
            "dynamic (with weight_block_size",
        ),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'", "e4m3"),
        (
            {"quant_method": "fp8", "activation_scheme": "per-token"},
            "activation_scheme",
            "dynamic, static",
        ),
    ],
)
def test_unsupported_modelopt_and_fp8_settings_name_the_field(qcfg, field, supported):
    with pytest.raises(ModelConfigError) as e:
        parse(qcfg)
    assert field in str(e.value) and supported in str(e.value), str(e.value)


def test_a_registered_format_whose_reader_is_missing_says_so(monkeypatch):
    monkeypatch.setitem(formats.FORMATS, ("gptq", None), ("no_such_reader", "INT4"))
    with pytest.raises(ModelConfigError, match="its reader .*no_such_reader.* is missing"):
        parse({"quant_method": "gptq", "bits": 4})


# -- tensors -------------------------------------------------------------------------------------


def fp8_tensors(out: int = 32, inp: int = 64, weights: str = "channel") -> dict:
    q, scale, _ = reference_quantize(torch.randn(out, inp), weights)
    return {"weight": q, "weight_scale": scale}


def test_decode_checks_every_tensor():
    scheme = parse(config_of("ct-fp8-channel"))
    tensors = fp8_tensors()
    qw = scheme.decode(tensors, 32, 64, Q)
    assert qw.scale.shape == (32,) and qw.input_scale is None
    bf16_scales = {**tensors, "weight_scale": tensors["weight_scale"].bfloat16()}
    assert scheme.decode(bf16_scales, 32, 64, Q).scale.dtype == torch.float32
    with pytest.raises(
        WeightLoadError, match=rf"lacks {Q}\.weight_scale, which compressed-tensors FP8"
    ):
        scheme.decode({"weight": tensors["weight"]}, 32, 64, Q)
    with pytest.raises(WeightLoadError) as e:
        scheme.decode({**tensors, "weight_scale": torch.ones(32, 2)}, 32, 64, Q)
    assert f"{Q}.weight_scale has shape (32, 2) float32" in str(e.value)
    assert "expects shape (32, 1) or (32,)" in str(e.value)
    with pytest.raises(
        WeightLoadError, match=r"weight has shape \(32, 64\) bfloat16.*float8_e4m3fn"
    ):
        scheme.decode({**tensors, "weight": torch.zeros(32, 64, dtype=torch.bfloat16)}, 32, 64, Q)
    with pytest.raises(WeightLoadError, match="not finite"):
        scheme.decode({**tensors, "weight_scale": torch.full((32, 1), float("nan"))}, 32, 64, Q)


def test_fp8_method_reads_either_scale_name():
    scheme = parse(config_of("fp8-tensor"))
    q, scale, deq = reference_quantize(torch.randn(16, 32), "tensor")
    for names in (("weight_scale", "input_scale"), ("weight_scale_inv", "activation_scale")):
        tensors = {"weight": q, names[0]: scale.reshape(()), names[1]: torch.tensor(0.01)}
        qw = scheme.decode(tensors, 16, 32, Q)
        torch.testing.assert_close(qw.dequantize(), deq, rtol=0, atol=0)
    with pytest.raises(WeightLoadError, match=r"lacks .*\.weight_scale \(or weight_scale_inv\)"):
        scheme.decode({"weight": q}, 16, 32, Q)


def test_block_scales_decode_exactly():
    scheme = parse(config_of("fp8-block"))
    q, scale, deq = reference_quantize(torch.randn(300, 200), "block")
    qw = scheme.decode({"weight": q, "weight_scale_inv": scale}, 300, 200, Q)
    assert qw.scale.shape == (3, 2) and qw.block == (128, 128)
    torch.testing.assert_close(qw.dequantize(), deq, rtol=0, atol=0)
    with pytest.raises(WeightLoadError, match=r"expects shape \(3, 2\)"):
        scheme.decode({"weight": q, "weight_scale_inv": scale[:2]}, 300, 200, Q)


@pytest.mark.parametrize("weights", ["channel", "tensor", "block"])
def test_load_time_quantization_matches_the_reference_quantizer(weights):
    w = torch.randn(200, 136)
    _, _, deq = reference_quantize(w, weights)
    block = (128, 128) if weights == "block" else None
    torch.testing.assert_close(quantize_fp8(w, weights, block).dequantize(), deq, rtol=0, atol=0)


# -- the quantized matmul -----------------------------------------------------------------------


def spec(activations: str, scaled_mm: bool, block=None) -> QuantSpec:
    return QuantSpec("fp8", activations, block, "scaled_mm" if scaled_mm else "dense", "test")


def matmul(qw, activations: str, scaled_mm: bool, dtype=torch.float32, reduce_max=None, block=None):
    m = QuantMatmul(
        qw.out_features,
        qw.in_features,
        spec(activations, scaled_mm, block),
        dtype,
        "cpu",
        reduce_max,
    )
    m.load(qw, "test")
    return m


@pytest.mark.parametrize("block", [None, (128, 128)])
def test_dense_path_fake_quantizes_activations_exactly(block):
    weights = "block" if block else "channel"
    q, scale, deq = reference_quantize(torch.randn(48, 256), weights)
    qw = quantize_fp8(deq, weights, block)  # the same values, batchrun's layout
    x = torch.randn(5, 256) * 3
    act = act_per_token_group if block else act_per_token
    want = torch.nn.functional.linear(act(x[None])[0], deq)
    got = matmul(qw, "dynamic", False, block=block)(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    static = quantize_fp8(deq, weights, block, torch.tensor(0.02))
    got = matmul(static, "static", False, block=block)(x)
    xq = (x / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn).float() * 0.02
    torch.testing.assert_close(got, torch.nn.functional.linear(xq, deq), rtol=0, atol=0)


@pytest.mark.parametrize("activations", ["dynamic", "static"])
@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("num", [1, 7])
def test_scaled_mm_path_matches_the_dequantized_reference(activations, per_tensor, num):
    """torch._scaled_mm (on the CPU here: torch has a reference implementation) with row-wise
    or tensor-wise scales, against F.linear on the dequantized weight and activations; one row
    too (a static scale spread over [1, 1] rows must still have unit strides). The reference
    quantizes x as the path does (act_quant's quant_per_token): fake_quant_dynamic's scale is
    amax / 448 in x's dtype, an ulp off amax * fp32(1 / 448) on some rows, and an ulp of scale
    moves the rounding of a value on an e4m3 midpoint."""
    torch.manual_seed(num + 2 * per_tensor + 4 * (activations == "static"))
    w = torch.randn(64, 128)
    input_scale = torch.tensor(0.03) if activations == "static" else None
    qw = quantize_fp8(w, "tensor" if per_tensor else "channel", None, input_scale)
    m = matmul(qw, activations, True, dtype=torch.bfloat16)
    assert m.weight.dtype == torch.float8_e4m3fn
    assert m.tensorwise == (per_tensor and activations == "static")
    x = torch.randn(num, 128, dtype=torch.bfloat16)
    got = m(x)
    if activations == "static":
        xq = (x.float() / 0.03).clamp(-448, 448).to(torch.float8_e4m3fn).float() * 0.03
    else:
        q, scale = quant_per_token(x)
        xq = q.float() * scale
    want = torch.nn.functional.linear(xq, qw.dequantize())
    assert got.dtype == torch.bfloat16 and got.shape == (num, 64)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


def test_row_parallel_per_token_scales_use_the_whole_row():
    """A row-parallel layer's per-token scale is the maximum over every rank's columns: with
    the other rank's maximum folded in, a rank quantizes its columns as TP=1 does."""
    w = torch.randn(16, 64)
    x = torch.randn(3, 64)
    qw = quantize_fp8(w, "channel")
    full = matmul(qw, "dynamic", False)(x)
    other_max = x[:, 32:].abs().amax(dim=-1, keepdim=True)
    reduce_max = lambda t: torch.maximum(t, other_max)  # noqa: E731
    halves = [
        matmul(qw.narrow_in(0, 32), "dynamic", False, reduce_max=reduce_max)(x[:, :32]),
        matmul(
            qw.narrow_in(32, 32),
            "dynamic",
            False,
            reduce_max=lambda t: torch.maximum(t, x[:, :32].abs().amax(dim=-1, keepdim=True)),
        )(x[:, 32:]),
    ]
    torch.testing.assert_close(halves[0] + halves[1], full, rtol=1e-5, atol=1e-5)


# -- kernels of a quantized model ----------------------------------------------------------------


def resolved(kernels: KernelPlan, quantized: bool = True) -> KernelPlan:
    from tiny_models import llama3_model_config

    cfg = llama3_model_config("tiny")
    if quantized:
        from dataclasses import replace

        cfg = replace(cfg, quantization=OnlineFp8Scheme())
    config = EngineConfig(device="cpu", overlap=False, chunked_prefill_size=64)
    return resolve_kernels(config, cfg, torch.device("cpu"), kernels)


def test_a_quantized_model_resolves_cublas_no_folded_norms_and_dequant_on_the_cpu():
    k = resolved(KernelPlan())
    assert (k.decode_gemv, k.decode_norms, k.fp8_matmul) == ("cublas", "off", "dequant")
    with pytest.raises(ValueError, match="fp8_matmul 'scaled_mm' needs .* sm_89"):
        resolved(KernelPlan(fp8_matmul="scaled_mm"))
    with pytest.raises(ValueError, match="fp8_matmul must be one of auto, scaled_mm, dequant"):
        KernelPlan(fp8_matmul="cutlass").validate()


@pytest.mark.parametrize(
    "qcfg,fp8_matmul,dtype,want",
    [
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128]},
            "scaled_mm",
            "bf16",
            "fp8_block",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128]},
            "scaled_mm",
            "fp32",
            "fp8_block",
        ),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "dequant", "bf16", "dense"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "scaled_mm", "bf16", "scaled_mm"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "scaled_mm", "fp32", "dense"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "dequant", "bf16", "dense"),
    ],
)
def test_plan_linear_picks_the_kernel(qcfg, fp8_matmul, dtype, want):
    """Block FP8 runs cuBLASLt's block matmul wherever fp8_matmul is "scaled_mm" (the plan
    keeps it there; its output in any dtype); per tensor / channel torch._scaled_mm in bf16."""
    from batchrun.quant.linear import fp8_quant, plan_linear

    if want == "fp8_block" and fp8_quant is None:
        want = "dense"  # no Triton: blocks are dequantized
    scheme = parse_quant_config({"quantization_config": qcfg}, "config.json")
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    spec = plan_linear(scheme, fp8_matmul, dt, ("q_proj", "k_proj", "v_proj"), 384, 256)
    assert spec.kernel == want and spec.keeps_fp8 == (want != "dense")
