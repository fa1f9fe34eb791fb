"""engine/kernel_choice.py's resolve_kernels: what each auto field of KernelPlan becomes on the
CPU and on a simulated GPU, and the requests it refuses with a message.

The GPU cases run without CUDA: `supports_pdl` (the device's compute capability), `has_triton`
`HostGate.available` (the driver's stream wait call) and attention/fa3_cache.py (FlashInfer's
FA3 prefill and its built kernels) are patched to describe an H200 (sm_90,
PDL) or an A100 (sm_80), and resolve_kernels reads nothing else of the device. ModelConfigs of
the Llama 3 shapes stand in for the models (no weights): llama-1b (hidden 2048, 1.0B decoder
parameters) and llama-8b (hidden 4096, 7.0B: batchrun.config.is_large).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_configs import MIXTRAL_8X7B_INSTRUCT, QWEN3_30B_A3B, QWEN15_MOE_A27B  # noqa: E402
from tiny_models import llama3_model_config  # noqa: E402

from batchrun.attention import fa3_cache  # noqa: E402
from batchrun.config import (  # noqa: E402
    CUDA_GRAPH_MAX_BS,
    EngineConfig,
    KernelPlan,
    is_large,
    resolve_sizes,
)
from batchrun.engine import kernel_choice  # noqa: E402
from batchrun.engine.kernel_choice import has_triton, resolve_kernels  # noqa: E402
from batchrun.models.config import ModelConfig  # noqa: E402
from batchrun.models.fused_decode import NORMS_IN_MATMUL_BEFORE_MAX_HIDDEN  # noqa: E402
from batchrun.models.hybrid_config import LinearAttentionConfig  # noqa: E402

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
H200_MEMORY = 150_000_000_000
SMALL, LARGE = llama3_model_config("llama-1b"), llama3_model_config("llama-8b")


def resolve(model_cfg=SMALL, device=CPU, kernels: KernelPlan | None = None, **config):
    """resolve_kernels as the engine calls it: sizes resolved, overlap decided (on for CUDA)."""
    config.setdefault("overlap", device.type == "cuda")
    engine_config = EngineConfig(device=device.type, **config)
    return resolve_kernels(resolve_sizes(engine_config, model_cfg), model_cfg, device, kernels)


@pytest.fixture
def gpu(monkeypatch):
    """A GPU with triton and the driver's stream wait: call with pdl=True for sm_90+ (an H200,
    with FP8 tensor cores), pdl=False for sm_80 (an A100, without); `memory` bytes (an H200's
    by default); fa3: FlashInfer's FA3 prefill runs the model (flashinfer installed, its kernels
    built); gemv_mma:
    kernels/int4_gemv_mma.py runs (Gluon, sm_80+)."""

    def make(pdl: bool, memory: int = H200_MEMORY, fa3: bool = False, gemv_mma=True) -> None:
        monkeypatch.setattr(kernel_choice, "gpu_memory", lambda device: memory)
        reason = None if fa3 else "flashinfer is not importable"
        monkeypatch.setattr(fa3_cache, "unavailable_reason", lambda *args: reason)
        monkeypatch.setattr(fa3_cache, "missing_modules", lambda *args: [])
        monkeypatch.setattr(fa3_cache, "probe_error", lambda *args: None)
        monkeypatch.setattr(fa3_cache, "start_build", lambda *args: pytest.fail("no build"))
        monkeypatch.setattr(kernel_choice, "has_triton", lambda: True)
        monkeypatch.setattr(kernel_choice, "supports_pdl", lambda device: pdl)
        monkeypatch.setattr(kernel_choice, "supports_fp8_matmul", lambda device: pdl)
        monkeypatch.setattr(kernel_choice, "supports_block_scaled_mm", lambda device: pdl)
        monkeypatch.setattr(kernel_choice, "supports_int4_gemv_mma", lambda device: gemv_mma)
        monkeypatch.setattr(kernel_choice, "supports_grouped_mm", lambda device: pdl)
        monkeypatch.setattr(kernel_choice.HostGate, "available", staticmethod(lambda: True))
        # 16 CPUs for this process, a Triton with the start-up compile pool's hooks
        monkeypatch.setattr(kernel_choice.os, "sched_getaffinity", lambda pid: set(range(16)))
        monkeypatch.setattr("batchrun.engine.precompile.supported", lambda: True)

    return make


def test_the_shapes_are_what_the_rules_are_stated_for():
    assert SMALL.hidden_size == NORMS_IN_MATMUL_BEFORE_MAX_HIDDEN < LARGE.hidden_size
    assert not is_large(SMALL) and is_large(LARGE)


# -- the CPU -------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_cfg", [SMALL, LARGE, llama3_model_config("tiny")])
def test_the_cpu_resolves_to_plain_torch(model_cfg):
    kernels = resolve(model_cfg)
    assert kernels == KernelPlan.reference()
    assert asdict(kernels) == dict(
        attention="torch",
        extend_attention="triton",
        triton_ops=False,
        pdl=False,
        decode_gemv="cublas",
        decode_norms="off",
        cuda_graph_max_bs=0,
        piecewise_graphs=False,
        host_gate=False,
        fp8_matmul="dequant",
        int4_matmul="dequant",
        fp8_fast_accum=True,
        moe="torch",
        moe_decode="grouped",
        moe_prefill="triton",
        compile_workers=0,
        per_layer_table="device",
        linear_attention="torch",
    )
    assert kernels.is_resolved


def test_the_cpu_has_no_decode_graphs():
    resolved = resolve(kernels=KernelPlan(cuda_graph_max_bs=64))
    assert resolved.cuda_graph_max_bs == 0 and resolved.piecewise_graphs is False


@pytest.mark.skipif(not has_triton(), reason="triton not installed")
def test_the_cpu_keeps_the_triton_kernels_set_by_hand():
    """Explicit Triton attention and kernels run on CPU tensors under Triton's interpreter (the
    *_interpreter tests); everything left auto still resolves to torch."""
    kernels = resolve(kernels=KernelPlan(attention="triton", triton_ops=True))
    assert kernels == replace(KernelPlan.reference(), attention="triton", triton_ops=True)
    kernels = resolve(kernels=KernelPlan(decode_gemv="triton"))
    assert (kernels.decode_gemv, kernels.decode_norms, kernels.pdl) == ("triton", "all", False)


def test_is_resolved_only_without_auto_fields():
    assert not KernelPlan().is_resolved
    assert not replace(KernelPlan.reference(), attention="auto").is_resolved
    assert not replace(KernelPlan.reference(), host_gate=None).is_resolved
    assert KernelPlan.reference().is_resolved


# -- requests that cannot run --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kernels", "message"),
    [
        (KernelPlan(pdl=True), "pdl needs the Triton kernels on an sm_90"),
        (KernelPlan(triton_ops=True, pdl=True), "pdl needs the Triton kernels on an sm_90"),
        (KernelPlan(host_gate=True), "host_gate needs CUDA, overlap and a driver"),
        (KernelPlan(piecewise_graphs=True), "piecewise CUDA graphs need CUDA"),
        (KernelPlan(decode_norms="all"), "decode_norms 'all' needs decode_gemv 'triton'"),
        (KernelPlan(attention="flashinfer"), "attention backend must be one of auto, torch, "),
    ],
)
def test_the_cpu_refuses(kernels, message):
    with pytest.raises(ValueError, match=message):
        resolve(kernels=kernels)


def test_the_triton_fields_need_triton(monkeypatch):
    monkeypatch.setattr(kernel_choice, "has_triton", lambda: False)
    with pytest.raises(ValueError, match="attention backend 'triton' needs the triton package"):
        resolve(kernels=KernelPlan(attention="triton"))
    with pytest.raises(ValueError, match="triton_ops needs the triton package"):
        resolve(kernels=KernelPlan(triton_ops=True))


@pytest.mark.parametrize(
    ("kernels", "message"),
    [
        (KernelPlan(attention="fast"), "attention backend must be one of auto, torch"),
        (KernelPlan(decode_gemv="fast"), "decode_gemv must be one of auto, cublas, triton"),
        (KernelPlan(decode_norms="some"), "decode_norms must be one of auto, off, all, fold-all"),
        (KernelPlan(cuda_graph_max_bs=-1), "cuda_graph_max_bs must be >= 0"),
    ],
)
def test_unknown_values_fail_validation(kernels, message):
    with pytest.raises(ValueError, match=message):
        resolve(kernels=kernels)


@pytest.mark.parametrize("mode", ["all", "fold-all"])
def test_norms_in_the_matmuls_need_the_triton_matmuls(gpu, mode):
    gpu(pdl=True)
    with pytest.raises(ValueError, match=f"decode_norms {mode!r} needs decode_gemv 'triton'"):
        resolve(device=CUDA, kernels=KernelPlan(decode_gemv="cublas", decode_norms=mode))


@pytest.mark.parametrize(
    ("model_cfg", "tp_size"),
    [
        (llama3_model_config("llama-1b", attention_bias=True), 1),  # qkv bias (Qwen2's)
        (llama3_model_config("llama-1b", mlp_bias=True), 1),
        (SMALL, 2),  # o_proj's and down_proj's all-reduce between the sums and the residual
    ],
)
def test_norms_in_the_matmuls_need_plain_whole_matmuls(gpu, model_cfg, tp_size):
    gpu(pdl=True)
    auto = resolve(model_cfg, CUDA, tp_size=tp_size)
    assert auto.decode_gemv == "triton" and auto.decode_norms == "off"
    kernels = KernelPlan(decode_norms="all")
    with pytest.raises(ValueError, match="a model without biases at tensor parallel size 1"):
        resolve(model_cfg, CUDA, kernels, tp_size=tp_size)


def test_pdl_needs_the_triton_kernels_and_sm_90(gpu):
    gpu(pdl=True)
    with pytest.raises(ValueError, match="pdl needs the Triton kernels"):
        resolve(device=CUDA, kernels=KernelPlan(triton_ops=False, pdl=True))
    gpu(pdl=False)
    with pytest.raises(ValueError, match="pdl needs the Triton kernels on an sm_90"):
        resolve(device=CUDA, kernels=KernelPlan(pdl=True))


def test_the_host_gate_needs_overlap_and_the_driver(gpu, monkeypatch):
    gpu(pdl=True)
    assert resolve(device=CUDA, overlap=False).host_gate is False
    with pytest.raises(ValueError, match="host_gate needs CUDA, overlap"):
        resolve(device=CUDA, kernels=KernelPlan(host_gate=True), overlap=False)
    monkeypatch.setattr(kernel_choice.HostGate, "available", staticmethod(lambda: False))
    assert resolve(device=CUDA).host_gate is False
    with pytest.raises(ValueError, match="a driver with stream memory operations"):
        resolve(device=CUDA, kernels=KernelPlan(host_gate=True))


# -- a GPU ---------------------------------------------------------------------------------------


def test_an_h200_runs_every_kernel_on_a_small_model(gpu):
    gpu(pdl=True, fa3=True)
    kernels = resolve(SMALL, CUDA)
    assert asdict(kernels) == dict(
        attention="triton",
        extend_attention="fa3",  # FlashInfer's FA3 prefill for the extend rows
        triton_ops=True,
        pdl=True,
        decode_gemv="triton",
        decode_norms="all",  # hidden 2048: each norm inside the matmul before it
        cuda_graph_max_bs=CUDA_GRAPH_MAX_BS,
        piecewise_graphs=True,  # a small model's mixed steps are bound by the host
        host_gate=True,
        fp8_matmul="scaled_mm",  # the FP8 linears of a quantized model on the tensor cores
        int4_matmul="dequant",  # a plain model's (INT4 ones: the rule below)
        fp8_fast_accum=True,
        moe="triton",  # a mixture's experts on kernels/fused_moe.py
        moe_decode="gemv",  # and its decode batches on kernels/moe_gemv.py
        moe_prefill="grouped_mm",  # its prefill batches on torch._grouped_mm (CUTLASS)
        compile_workers=8,  # the capture's Triton variants compiled by 8 processes first
        per_layer_table="device",  # no per-layer table
        linear_attention="torch",
    )
    assert kernels.is_resolved


def test_an_h200_folds_the_norms_of_a_wide_model_and_keeps_its_mixed_steps_eager(gpu):
    gpu(pdl=True)
    kernels = resolve(LARGE, CUDA)
    assert kernels.decode_gemv == "triton" and kernels.pdl is True
    assert kernels.decode_norms == "fold-all"  # hidden 4096: both norms in the matmul after
    assert kernels.piecewise_graphs is False  # 3B+ decoder parameters
    assert kernels.cuda_graph_max_bs == CUDA_GRAPH_MAX_BS


def test_piecewise_graphs_need_decode_graphs_and_a_chunk_size(gpu):
    gpu(pdl=True)
    no_graphs = resolve(SMALL, CUDA, KernelPlan(cuda_graph_max_bs=0))
    assert no_graphs.cuda_graph_max_bs == 0 and no_graphs.piecewise_graphs is False
    # an unlimited prefill (chunked_prefill_size None) bounds no step's tokens
    assert resolve(SMALL, CUDA, chunked_prefill_size=None).piecewise_graphs is False
    kernels = KernelPlan(piecewise_graphs=None)
    assert resolve(SMALL, CUDA, kernels, chunked_prefill_size=None).piecewise_graphs is False
    with pytest.raises(ValueError, match="need CUDA and a chunked prefill size"):
        resolve(SMALL, CUDA, KernelPlan(piecewise_graphs=True), chunked_prefill_size=None)
    assert resolve(LARGE, CUDA, KernelPlan(piecewise_graphs=True)).piecewise_graphs is True
    assert resolve(SMALL, CUDA, KernelPlan(piecewise_graphs=False)).piecewise_graphs is False


def test_without_pdl_the_decode_matmuls_take_cublas(gpu):
    """--disable-pdl on an H200: the Triton matmuls pay only with PDL, so auto gives cuBLAS and
    no norms in the matmuls; asked for by hand they stay, with the norms by the width rule."""
    gpu(pdl=True)
    kernels = resolve(SMALL, CUDA, KernelPlan(pdl=False))
    assert (kernels.triton_ops, kernels.pdl) == (True, False)
    assert (kernels.decode_gemv, kernels.decode_norms) == ("cublas", "off")
    kernels = resolve(SMALL, CUDA, KernelPlan(pdl=False, decode_gemv="triton"))
    assert (kernels.decode_gemv, kernels.decode_norms) == ("triton", "all")


def test_an_sm_80_gpu_has_no_pdl_and_keeps_cublas(gpu):
    gpu(pdl=False)
    for model_cfg in (SMALL, LARGE):
        kernels = resolve(model_cfg, CUDA)
        assert kernels.attention == "triton" and kernels.triton_ops is True
        assert kernels.pdl is False
        assert kernels.decode_gemv == "cublas" and kernels.decode_norms == "off"
    explicit = resolve(LARGE, CUDA, KernelPlan(decode_gemv="triton"))
    assert (explicit.decode_gemv, explicit.decode_norms) == ("triton", "fold-all")


def test_a_gpu_without_triton_runs_torch_and_cublas(gpu, monkeypatch):
    gpu(pdl=True)
    monkeypatch.setattr(kernel_choice, "has_triton", lambda: False)
    kernels = resolve(SMALL, CUDA)
    assert (kernels.attention, kernels.triton_ops, kernels.pdl) == ("torch", False, False)
    assert (kernels.decode_gemv, kernels.decode_norms) == ("cublas", "off")
    assert kernels.cuda_graph_max_bs == CUDA_GRAPH_MAX_BS


def test_fields_set_by_hand_are_kept(gpu):
    gpu(pdl=True)
    want = KernelPlan(
        attention="torch",
        extend_attention="triton",
        triton_ops=True,
        pdl=True,
        decode_gemv="triton",
        decode_norms="all",
        cuda_graph_max_bs=64,
        piecewise_graphs=False,
        host_gate=False,
        fp8_matmul="dequant",
        int4_matmul="dequant",
        fp8_fast_accum=True,
        moe="torch",
        moe_decode="grouped",
        moe_prefill="triton",
        compile_workers=2,
        per_layer_table="device",
        linear_attention="torch",
    )
    assert resolve(SMALL, CUDA, want) == want


# -- a quantized model ---------------------------------------------------------------------------


def quantized(model_cfg):
    from batchrun.quant.online import OnlineFp8Scheme

    return replace(model_cfg, quantization=OnlineFp8Scheme())


def test_a_quantized_model_on_an_h200_decodes_on_the_triton_kernels_without_folded_norms(gpu):
    """A quantized model's decode batches run on kernels/fp8_gemv.py (and gemv.py for its bf16
    layers) with PDL, on cuBLAS (torch._scaled_mm for FP8) when set by hand; its norms stay
    kernels of their own: decode_norms other than "off" is refused (kernels/fp8_gemv.py and the
    INT4 GEMV have no residual epilogue, and norms fold into bf16 weights only)."""
    gpu(pdl=True)
    for model_cfg in (quantized(SMALL), quantized(LARGE)):
        kernels = resolve(model_cfg, CUDA)
        assert (kernels.decode_gemv, kernels.decode_norms) == ("triton", "off")
        assert kernels.fp8_matmul == "scaled_mm" and kernels.pdl is True
    assert resolve(SMALL, CUDA, quantization="fp8").decode_gemv == "triton"
    hand_set = resolve(quantized(SMALL), CUDA, KernelPlan(decode_gemv="cublas"))
    assert (hand_set.decode_gemv, hand_set.decode_norms) == ("cublas", "off")
    for mode in ("all", "fold-all"):
        with pytest.raises(ValueError, match=f"decode_norms '{mode}' needs .* unquantized"):
            resolve(quantized(LARGE), CUDA, KernelPlan(decode_norms=mode))
        with pytest.raises(ValueError, match=f"decode_norms '{mode}' needs .* unquantized"):
            resolve(int4(LARGE), CUDA, KernelPlan(decode_norms=mode))
    assert resolve(quantized(SMALL), CUDA, KernelPlan(fp8_matmul="dequant")).fp8_matmul == (
        "dequant"
    )


def int4(model_cfg):
    from batchrun.quant.formats.awq import parse

    scheme = parse({"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 128,
                    "zero_point": True}, "test")  # fmt: skip
    return replace(model_cfg, quantization=scheme)


def fp8_blocks(model_cfg):
    from batchrun.quant.formats.fp8 import parse

    scheme = parse({"quant_method": "fp8", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}, "test")  # fmt: skip
    return replace(model_cfg, quantization=scheme)


def test_int4_is_dequantized_where_the_bf16_weights_fit(gpu, monkeypatch):
    """On CUDA, an INT4 model's weights are dequantized to bf16 at load where that takes at most
    DEQUANT_MAX_MEMORY of the GPU (llama-8b's 15 GB of an H200's 150), else kept packed on
    kernels/int4_matmul.py (llama-8b on a 24 GB GPU; or llama-8b's ranks at TP=2 on a 16 GB
    one: half each). An INT4 model also keeps its packed
    weight for the decode GEMV ("dequant-gemv") where both fit and the GEMV runs (llama-8b's
    ranks at TP=2 on a 16 GB GPU: the bf16 half fits, not with the copy). A hand-set choice is
    kept. The CPU dequantizes unless "triton" is set by hand (Triton's interpreter), which
    needs triton; "dequant-gemv" needs the GEMV."""
    gpu(pdl=True)
    assert resolve(int4(LARGE), CUDA).int4_matmul == "dequant-gemv"
    gpu(pdl=True, memory=24_000_000_000)
    assert resolve(int4(LARGE), CUDA).int4_matmul == "triton"
    assert resolve(int4(SMALL), CUDA).int4_matmul == "dequant-gemv"
    gpu(pdl=True, memory=16_000_000_000)
    assert resolve(int4(LARGE), CUDA).int4_matmul == "triton"
    assert resolve(int4(LARGE), CUDA, tp_size=2).int4_matmul == "dequant"
    gpu(pdl=True, gemv_mma=False)
    assert resolve(int4(LARGE), CUDA).int4_matmul == "dequant"
    with pytest.raises(ValueError, match="int4_matmul 'dequant-gemv' .* needs an sm_80"):
        resolve(int4(LARGE), CUDA, KernelPlan(int4_matmul="dequant-gemv"))
    with pytest.raises(ValueError, match="int4_matmul 'dequant-gemv' .* needs an sm_80"):
        resolve(int4(SMALL), CPU, KernelPlan(int4_matmul="dequant-gemv"))
    gpu(pdl=True)
    hand_set = KernelPlan(int4_matmul="dequant", fp8_matmul="dequant")
    assert resolve(int4(LARGE), CUDA, hand_set).int4_matmul == "dequant"
    assert resolve(fp8_blocks(LARGE), CUDA, hand_set).fp8_matmul == "dequant"
    assert resolve(int4(SMALL)).int4_matmul == "dequant"
    assert resolve(SMALL, CPU, KernelPlan(int4_matmul="triton")).int4_matmul == "triton"
    monkeypatch.setattr(kernel_choice, "has_triton", lambda: False)
    assert resolve(int4(LARGE), CUDA).int4_matmul == "dequant"
    with pytest.raises(ValueError, match="int4_matmul 'triton' .* needs the triton package"):
        resolve(int4(SMALL), CUDA, KernelPlan(int4_matmul="triton"))
    with pytest.raises(ValueError, match="int4_matmul must be one of auto, triton, dequant"):
        resolve(int4(SMALL), CPU, KernelPlan(int4_matmul="marlin"))


def test_fp8_matmuls_need_sm_89(gpu):
    gpu(pdl=False)
    assert resolve(quantized(SMALL), CUDA).fp8_matmul == "dequant"
    with pytest.raises(ValueError, match="fp8_matmul 'scaled_mm' needs the FP8 tensor cores"):
        resolve(quantized(SMALL), CUDA, KernelPlan(fp8_matmul="scaled_mm"))


# -- a mixture of experts ------------------------------------------------------------------------


def test_a_mixture_of_experts_runs_the_fused_moe_on_cuda(gpu, monkeypatch):
    """auto: the fused Triton MoE on CUDA (its module must import at start-up), the torch loop on
    the CPU; the torch loop reads the routing on the host, so it is refused with CUDA graphs."""
    moe_cfg = ModelConfig.from_dict(QWEN3_30B_A3B)
    assert resolve(moe_cfg).moe == "torch"
    gpu(pdl=True)
    checked = []
    monkeypatch.setattr(
        kernel_choice, "_check_kernels_import", lambda module="gemv": checked.append(module)
    )
    kernels = resolve(moe_cfg, CUDA)
    assert kernels.moe == "triton"
    assert "batchrun.kernels.fused_moe" in checked
    with pytest.raises(ValueError, match="moe 'torch' reads the routing on the host, which a CUDA"):
        resolve(moe_cfg, CUDA, KernelPlan(moe="torch"))
    eager = resolve(moe_cfg, CUDA, KernelPlan(moe="torch", cuda_graph_max_bs=0))
    assert eager.moe == "torch" and not eager.piecewise_graphs
    assert resolve(SMALL, CUDA, KernelPlan(moe="torch")).moe == "torch"  # dense: no experts
    # a small dense model takes piecewise graphs by default; experts take them when asked
    assert resolve(SMALL, CUDA).piecewise_graphs
    small_moe = replace(SMALL, moe=moe_cfg.moe)
    assert not resolve(small_moe, CUDA).piecewise_graphs
    assert resolve(small_moe, CUDA, KernelPlan(piecewise_graphs=True)).piecewise_graphs


def test_gelu_tanh_experts_run_fused_on_cuda(gpu, monkeypatch):
    """Gemma 4's experts (a GELU-tanh gate) take the fused experts on CUDA, so CUDA graphs too;
    an activation the epilogues do not run keeps the torch loop, and asking for the fused
    experts names the ones they run."""
    moe_cfg = ModelConfig.from_dict(QWEN3_30B_A3B)
    gelu = replace(moe_cfg, moe=replace(moe_cfg.moe, act="gelu_pytorch_tanh"))
    gpu(pdl=True)
    monkeypatch.setattr(kernel_choice, "_check_kernels_import", lambda module="gemv": None)
    kernels = resolve(gelu, CUDA)
    assert (kernels.moe, kernels.moe_decode) == ("triton", "gemv") and kernels.cuda_graph_max_bs
    other = replace(moe_cfg, moe=replace(moe_cfg.moe, act="relu2"))
    assert resolve(other, CUDA, KernelPlan(cuda_graph_max_bs=0)).moe == "torch"
    with pytest.raises(ValueError, match="experts gated by .*gelu_pytorch_tanh.*relu2"):
        resolve(other, CUDA, KernelPlan(moe="triton"))


def test_moe_decode_gemv_with_the_fused_experts(gpu, monkeypatch):
    """moe_decode auto: "gemv" (kernels/moe_gemv.py for the decode batches) with the fused
    experts, its module checked at start-up; the grouped GEMMs for every batch when asked, and
    with the per-expert loop."""
    moe_cfg = ModelConfig.from_dict(QWEN3_30B_A3B)
    assert resolve(moe_cfg).moe_decode == "grouped"  # the CPU: moe "torch"
    with pytest.raises(ValueError, match="moe_decode 'gemv' .* needs moe 'triton'"):
        resolve(moe_cfg, CPU, KernelPlan(moe_decode="gemv"))
    with pytest.raises(ValueError, match="moe_decode must be one of auto, grouped, gemv"):
        resolve(moe_cfg, CPU, KernelPlan(moe_decode="split"))
    gpu(pdl=True)
    checked = []
    monkeypatch.setattr(
        kernel_choice, "_check_kernels_import", lambda module="gemv": checked.append(module)
    )
    assert resolve(moe_cfg, CUDA, KernelPlan(moe_decode="grouped")).moe_decode == "grouped"
    assert "batchrun.kernels.moe_gemv" not in checked
    assert resolve(moe_cfg, CUDA).moe_decode == "gemv"
    assert "batchrun.kernels.moe_gemv" in checked
    assert resolve(moe_cfg, CUDA, KernelPlan(moe="torch", cuda_graph_max_bs=0)).moe_decode == (
        "grouped"
    )


def test_a_mixtures_one_token_decode_takes_the_norms_into_its_gemvs(gpu):
    """decode_norms auto on a mixture: the residual add and the next norm inside the experts'
    down GEMV (kernels/moe_gemv.py) with "all" up to hidden 2048 (Qwen3-30B-A3B), "off" above
    (Mixtral: no gate_up weight for "fold-all"); "off" with the grouped GEMMs for decode, or a
    shared expert and biases (Qwen1.5-MoE); each refused where it cannot run."""
    gpu(pdl=True)
    qwen3 = ModelConfig.from_dict(QWEN3_30B_A3B)
    mixtral = ModelConfig.from_dict(MIXTRAL_8X7B_INSTRUCT)
    shared = ModelConfig.from_dict(QWEN15_MOE_A27B)
    assert resolve(qwen3, CUDA).decode_norms == "all"
    assert resolve(mixtral, CUDA).decode_norms == "off"
    assert resolve(shared, CUDA).decode_norms == "off"
    grouped = KernelPlan(moe_decode="grouped")
    assert resolve(qwen3, CUDA, grouped).decode_norms == "off"
    for mode in ("all",):
        assert resolve(mixtral, CUDA, KernelPlan(decode_norms=mode)).decode_norms == mode
    with pytest.raises(ValueError, match="decode_norms 'fold-all' folds the post-attention"):
        resolve(mixtral, CUDA, KernelPlan(decode_norms="fold-all"))
    for cfg, kernels in ((shared, KernelPlan()), (qwen3, grouped)):
        with pytest.raises(ValueError, match="decode_norms 'all' needs .* experts alone"):
            resolve(cfg, CUDA, replace(kernels, decode_norms="all"))


def test_moe_prefill_grouped_mm_where_cutlass_runs(gpu, monkeypatch):
    """moe_prefill auto: "grouped_mm" (kernels/moe_grouped_mm.py) with the fused experts in bf16
    where torch._grouped_mm runs CUTLASS's grouped GEMM (sm_90), its module checked at start-up;
    "triton" elsewhere; "grouped_mm" asked for is refused without it on CUDA, and beside the
    per-expert loop; the CPU runs it when asked (torch's CPU grouped matmul, the interpreter)."""
    moe_cfg = ModelConfig.from_dict(QWEN3_30B_A3B)
    assert resolve(moe_cfg).moe_prefill == "triton"  # the CPU: moe "torch"
    with pytest.raises(ValueError, match="moe_prefill 'grouped_mm' .* runs with moe 'triton'"):
        resolve(moe_cfg, CPU, KernelPlan(moe_prefill="grouped_mm"))
    monkeypatch.setattr(kernel_choice, "has_triton", lambda: True)
    cpu = resolve(moe_cfg, CPU, KernelPlan(moe="triton", moe_prefill="grouped_mm"))
    assert cpu.moe_prefill == "grouped_mm"
    with pytest.raises(ValueError, match="moe_prefill must be one of auto, triton, grouped_mm"):
        resolve(moe_cfg, CPU, KernelPlan(moe_prefill="cutlass"))
    gpu(pdl=True)
    checked = []
    monkeypatch.setattr(
        kernel_choice, "_check_kernels_import", lambda module="gemv": checked.append(module)
    )
    assert resolve(moe_cfg, CUDA, KernelPlan(moe_prefill="triton")).moe_prefill == "triton"
    assert "batchrun.kernels.moe_grouped_mm" not in checked
    assert resolve(moe_cfg, CUDA).moe_prefill == "grouped_mm"
    assert "batchrun.kernels.moe_grouped_mm" in checked
    assert resolve(moe_cfg, CUDA, dtype="float16").moe_prefill == "triton"  # bf16 only
    with pytest.raises(ValueError, match="bf16 on an sm_90 GPU"):
        resolve(moe_cfg, CUDA, KernelPlan(moe_prefill="grouped_mm"), dtype="float16")
    gpu(pdl=False)  # an A100
    assert resolve(moe_cfg, CUDA).moe_prefill == "triton"
    with pytest.raises(ValueError, match="bf16 on an sm_90 GPU"):
        resolve(moe_cfg, CUDA, KernelPlan(moe_prefill="grouped_mm"))


def test_extend_attention_fa3_where_it_runs(gpu, monkeypatch):
    """extend_attention auto: "fa3" with attention "triton" where fa3_cache.unavailable_reason
    finds nothing against it (flashinfer, sm_90, the head dim, the dtypes, no sinks) and its
    kernels are built, else "triton"; "fa3" asked for is refused where it cannot run or beside
    another attention backend."""
    assert resolve(SMALL).extend_attention == "triton"  # the CPU
    with pytest.raises(ValueError, match="extend_attention must be one of auto, triton, fa3"):
        resolve(SMALL, CPU, KernelPlan(extend_attention="fa2"))
    with pytest.raises(ValueError, match="extend_attention 'fa3' runs attention 'triton''s"):
        resolve(SMALL, CPU, KernelPlan(extend_attention="fa3"))
    gpu(pdl=True)
    with pytest.raises(ValueError, match="'fa3' cannot run here: flashinfer is not importable"):
        resolve(SMALL, CUDA, KernelPlan(extend_attention="fa3"))
    assert resolve(SMALL, CUDA).extend_attention == "triton"
    gpu(pdl=True, fa3=True)
    assert resolve(SMALL, CUDA).extend_attention == "fa3"
    assert resolve(SMALL, CUDA, KernelPlan(attention="torch")).extend_attention == "triton"
    explicit = KernelPlan(extend_attention="triton")
    assert resolve(SMALL, CUDA, explicit).extend_attention == "triton"
    fa3 = KernelPlan(extend_attention="fa3")
    assert resolve(SMALL, CUDA, fa3).extend_attention == "fa3"
    with pytest.raises(ValueError, match="runs attention 'triton''s extend rows, and the attent"):
        resolve(SMALL, CUDA, replace(fa3, attention="torch"))
    seen = []
    monkeypatch.setattr(fa3_cache, "unavailable_reason", lambda *args: seen.append(args) or "sinks")
    with pytest.raises(ValueError, match="'fa3' cannot run here: sinks"):
        resolve(SMALL, CUDA, fa3)
    assert seen[0][1:] == (SMALL.head_dim, "auto", False, False)
    assert resolve(SMALL, CUDA).extend_attention == "triton"


def test_extend_attention_fa3_only_where_its_kernels_are_built(gpu, monkeypatch, caplog):
    """No compiler on the start-up path: where FA3's kernels are not built, the extend rows run
    on the Triton kernel and rank 0 starts their build in the background (where nvcc is), for
    the next run; where they are built, one FA3 prefill runs at start-up with one rank's heads
    and the dtype (fa3_cache.probe_error), and its failure keeps the Triton kernel."""
    gpu(pdl=True, fa3=True)
    missing, builds, nvcc = [["fa3_module"]], [], ["/usr/local/cuda/bin/nvcc"]
    monkeypatch.setattr(fa3_cache, "missing_modules", lambda *args: missing[0])
    monkeypatch.setattr(fa3_cache, "find_nvcc", lambda: nvcc[0])
    monkeypatch.setattr(
        fa3_cache, "start_build", lambda *args: builds.append(args) or Path("/tmp/build.log")
    )
    with caplog.at_level("INFO", logger=kernel_choice.__name__):
        assert resolve(LARGE, CUDA).extend_attention == "triton"
    assert builds == [(128, torch.bfloat16, (0,))]
    assert "a background process builds them for the next run" in caplog.text
    assert "/tmp/build.log" in caplog.text
    assert resolve(LARGE, CUDA, tp_size=2, tp_rank=1).extend_attention == "triton"
    assert len(builds) == 1  # rank 0 builds
    mixed = replace(LARGE, sliding_windows=(4096, 0) * 16)
    assert resolve(mixed, CUDA, dtype="float16").extend_attention == "triton"
    assert builds[-1] == (128, torch.float16, mixed.sliding_windows)
    nvcc[0] = None
    with pytest.raises(ValueError, match=r"not built here, and no nvcc .* flashinfer-jit-cache"):
        resolve(LARGE, CUDA, KernelPlan(extend_attention="fa3"))
    assert len(builds) == 2

    missing[0] = []
    seen, error = [], [None]
    monkeypatch.setattr(fa3_cache, "probe_error", lambda *args: seen.append(args) or error[0])
    with caplog.at_level("INFO", logger=kernel_choice.__name__):
        assert resolve(LARGE, CUDA, tp_size=2).extend_attention == "fa3"
    assert seen[-1][1:] == (16, 4, 128, torch.bfloat16, (0,))
    assert "FA3 prefill ran its start-up batch in" in caplog.text
    error[0] = "RuntimeError: an illegal instruction was encountered"
    with caplog.at_level("INFO", logger=kernel_choice.__name__):
        assert resolve(LARGE, CUDA).extend_attention == "triton"
    assert "extend rows run on the Triton kernel, not FA3: FlashInfer's FA3 prefill failed" in (
        caplog.text
    )
    with pytest.raises(ValueError, match="'fa3' cannot run here: FlashInfer's FA3 prefill fail"):
        resolve(LARGE, CUDA, KernelPlan(extend_attention="fa3"))
    calls = len(seen)
    assert resolve(LARGE, CUDA, KernelPlan(extend_attention="triton")).extend_attention == (
        "triton"
    )
    assert len(seen) == calls  # nothing runs where the extend rows stay on Triton


def test_moe_triton_needs_triton(monkeypatch):
    monkeypatch.setattr(kernel_choice, "has_triton", lambda: False)
    with pytest.raises(ValueError, match="moe 'triton' .* needs the triton package"):
        resolve(ModelConfig.from_dict(QWEN3_30B_A3B), CPU, KernelPlan(moe="triton"))


def test_gemma3_decodes_with_its_norms_apart(gpu):
    """Gemma 3's norms sit between the matmuls and the residual adds (four a layer): its decode
    keeps them as kernels of their own ("off"), and asking for them inside the GEMVs is
    refused."""
    from gemma3_configs import GEMMA3_1B_IT

    gpu(pdl=True)
    gemma = ModelConfig.from_dict(GEMMA3_1B_IT)
    kernels = resolve(gemma, CUDA)
    assert (kernels.decode_gemv, kernels.decode_norms) == ("triton", "off")
    with pytest.raises(ValueError, match=r"decode_norms 'all' needs .* \(no sandwich norms\)"):
        resolve(gemma, CUDA, KernelPlan(decode_norms="all"))


def test_block_fp8_needs_cublaslt_or_room_to_dequantize(gpu, monkeypatch):
    """Block FP8 stays in FP8 only on cuBLASLt's block matmul (sm_90, a torch with CUDA 12.9+);
    without it, a model whose bf16 weights fit is dequantized, and one too large to dequantize
    is refused by name at start-up, as "scaled_mm" asked for there."""
    gpu(pdl=True)
    assert resolve(fp8_blocks(LARGE), CUDA).fp8_matmul == "scaled_mm"
    monkeypatch.setattr(kernel_choice, "supports_block_scaled_mm", lambda device: False)
    assert resolve(fp8_blocks(LARGE), CUDA).fp8_matmul == "dequant"
    with pytest.raises(ValueError, match="fp8_matmul 'scaled_mm' runs 128 x 128 block-FP8"):
        resolve(fp8_blocks(LARGE), CUDA, KernelPlan(fp8_matmul="scaled_mm"))
    assert resolve(quantized(LARGE), CUDA).fp8_matmul == "scaled_mm"  # per channel: any sm_89+
    gpu(pdl=True, memory=24_000_000_000)
    monkeypatch.setattr(kernel_choice, "supports_block_scaled_mm", lambda device: False)
    with pytest.raises(ValueError, match=r"cuBLASLt's block-scaled matmul.*and is missing here; "
                       r"dequantized, the decoder's bf16 weights take 14.0 GB"):  # fmt: skip
        resolve(fp8_blocks(LARGE), CUDA)
    assert resolve(fp8_blocks(LARGE), CUDA, tp_size=2).fp8_matmul == "dequant"


def test_dequantize_is_the_users_choice(gpu):
    """EngineConfig.dequantize (--dequantize): a quantized checkpoint's weights dequantized at
    load wherever the rules would keep them."""
    gpu(pdl=True)
    assert resolve(quantized(LARGE), CUDA, dequantize=True).fp8_matmul == "dequant"
    assert resolve(int4(LARGE), CUDA, dequantize=True).int4_matmul == "dequant"
    gpu(pdl=True, memory=24_000_000_000)
    assert resolve(int4(LARGE), CUDA).int4_matmul == "triton"
    assert resolve(int4(LARGE), CUDA, dequantize=True).int4_matmul == "dequant"


def test_the_users_kernel_choices(gpu):
    """EngineConfig's kernel choices: the reference path (every field the override leaves is the
    reference's), CUDA graphs' largest batch (0: none, piecewise ones neither), PDL and the host
    gate off."""
    gpu(pdl=True)
    reference = resolve(SMALL, CUDA, reference_kernels=True)
    assert reference == KernelPlan.reference()
    partial = resolve(SMALL, CUDA, KernelPlan(attention="triton"), reference_kernels=True)
    assert partial == replace(KernelPlan.reference(), attention="triton")
    assert resolve(SMALL, CUDA, cuda_graph_max_bs=64).cuda_graph_max_bs == 64
    none = resolve(SMALL, CUDA, cuda_graph_max_bs=0)
    assert (none.cuda_graph_max_bs, none.piecewise_graphs) == (0, False)
    assert resolve(SMALL, CUDA, piecewise_graphs=False).piecewise_graphs is False
    no_pdl = resolve(SMALL, CUDA, pdl=False)
    assert (no_pdl.pdl, no_pdl.decode_gemv, no_pdl.decode_norms) == (False, "cublas", "off")
    assert resolve(SMALL, CUDA, host_gate=False).host_gate is False
    with pytest.raises(ValueError, match="cuda_graph_max_bs must be >= 0"):
        EngineConfig(cuda_graph_max_bs=-1).validate()


# -- the start-up compile pool -------------------------------------------------------------------


@pytest.mark.parametrize("cpus, workers", [(2, 0), (3, 0), (4, 2), (5, 2), (16, 8), (64, 8)])
def test_compile_workers_follow_the_cpus_a_dense_model_gets(gpu, monkeypatch, cpus, workers):
    gpu(pdl=True)
    monkeypatch.setattr(kernel_choice.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert resolve(LARGE, CUDA).compile_workers == workers


def test_compile_workers_none_without_graphs_experts_or_the_hooks(gpu, monkeypatch):
    gpu(pdl=True)
    assert resolve(LARGE, CUDA, kernels=KernelPlan(cuda_graph_max_bs=0)).compile_workers == 0
    assert resolve(ModelConfig.from_dict(QWEN3_30B_A3B), CUDA).compile_workers == 0
    assert resolve(HYBRID, CUDA).compile_workers == 0
    monkeypatch.setattr("batchrun.engine.precompile.supported", lambda: False)
    assert resolve(LARGE, CUDA).compile_workers == 0


def test_compile_workers_share_the_cpus_between_tensor_parallel_ranks(gpu):
    gpu(pdl=True)
    assert resolve(LARGE, CUDA, tp_size=2).compile_workers == 4
    assert resolve(LARGE, CUDA, tp_size=8).compile_workers == 0  # one a rank: no pool


def test_compile_workers_set_by_hand(gpu):
    gpu(pdl=True)
    assert resolve(LARGE, CUDA, kernels=KernelPlan(compile_workers=3)).compile_workers == 3
    with pytest.raises(ValueError, match="compile_workers must be 0 or more"):
        resolve(LARGE, CUDA, kernels=KernelPlan(compile_workers=-1))


# -- a per-layer embedding table ------------------------------------------------------------------

# Gemma 4 E2B's per-layer table: vocab 262,144 x 35 layers x 256
E2B_TABLE = 262_144 * 35 * 256


def test_per_layer_table_goes_to_the_host_where_it_is_a_large_share(gpu, monkeypatch):
    """per_layer_table "device" on the CPU, without a table, and on a GPU where the table is a
    small share of the memory (an H200: 4.7 GB of 150); "host" on a 24 GB GPU; "host" asked for
    where it cannot run is refused by name."""
    e_model = replace(SMALL, host_table_elements=E2B_TABLE)
    assert resolve(e_model).per_layer_table == "device"
    with pytest.raises(ValueError, match="per_layer_table 'host' keeps a per-layer embedding"):
        resolve(e_model, CPU, KernelPlan(per_layer_table="host"))
    checked = []
    monkeypatch.setattr(
        kernel_choice, "_check_kernels_import", lambda module="gemv": checked.append(module)
    )
    gpu(pdl=True)
    assert resolve(e_model, CUDA).per_layer_table == "device"
    assert resolve(SMALL, CUDA).per_layer_table == "device"
    assert resolve(e_model, CUDA, KernelPlan(per_layer_table="host")).per_layer_table == "host"
    assert "batchrun.kernels.host_gather" in checked
    with pytest.raises(ValueError, match="it needs such a table"):
        resolve(SMALL, CUDA, KernelPlan(per_layer_table="host"))
    gpu(pdl=True, memory=24_000_000_000)
    assert resolve(e_model, CUDA).per_layer_table == "host"
    assert resolve(e_model, CUDA, KernelPlan(per_layer_table="device")).per_layer_table == "device"
    with pytest.raises(ValueError, match="per_layer_table must be one of"):
        resolve(e_model, CUDA, KernelPlan(per_layer_table="disk"))


HYBRID = replace(
    SMALL,
    linear_attention=LinearAttentionConfig(
        layers=(0, 1), num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16,
        conv_kernel=4, fused_projections=False,
    ),
)  # fmt: skip


def test_linear_attention_runs_fla_on_the_gpu_where_it_imports(gpu, monkeypatch):
    gpu(pdl=True)
    monkeypatch.setattr(kernel_choice, "has_fla", lambda: True)
    monkeypatch.setattr(kernel_choice, "_check_kernels_import", lambda *args: None)
    assert resolve(HYBRID, CUDA).linear_attention == "fla"
    assert resolve(SMALL, CUDA).linear_attention == "torch"  # no linear layers
    want = KernelPlan(linear_attention="torch")  # a benchmark's override
    assert resolve(HYBRID, CUDA, want).linear_attention == "torch"
    assert resolve(HYBRID, CUDA, reference_kernels=True).linear_attention == "torch"
    monkeypatch.setattr(kernel_choice, "has_fla", lambda: False)
    assert resolve(HYBRID, CUDA).linear_attention == "torch"
    with pytest.raises(ValueError, match="linear_attention 'fla'.*fla-core"):
        resolve(HYBRID, CUDA, KernelPlan(linear_attention="fla"))


def test_linear_attention_is_torch_on_the_cpu():
    assert resolve(HYBRID).linear_attention == "torch"
    with pytest.raises(ValueError, match="linear_attention 'fla'.*CUDA"):
        resolve(HYBRID, CPU, KernelPlan(linear_attention="fla"))
    with pytest.raises(ValueError, match="linear_attention must be one of"):
        KernelPlan(linear_attention="cuda").validate()
