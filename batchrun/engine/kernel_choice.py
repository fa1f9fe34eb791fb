"""The kernel config an engine runs, resolved once at start-up (batchrun/config.py's KernelConfig
says what each field is).

    requested = config.kernels                 # "auto" / None where the user left the choice
    kernels = resolve_kernels(config, model_cfg, device)   # every field concrete

Auto fields follow the device, what is installed, the GPU's capability and the model's shape;
a field set by hand is kept, or refused with a message when it cannot run here. Nothing here is
read again on the step path: every block is built with the resolved config.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import time
from dataclasses import replace

import torch

from batchrun.attention.flashinfer_backend import (
    PROBE_TOKENS,
    fa3_run_error,
    fa3_unavailable_reason,
    unavailable_reason,
)
from batchrun.config import EngineConfig, KernelConfig, decoder_params, is_large
from batchrun.engine.host_gate import HostGate
from batchrun.models.fused_decode import resolve_mode as resolve_decode_norms
from batchrun.models.moe_weights import has_quantized_experts

log = logging.getLogger(__name__)


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _check_kernels_import(module: str = "batchrun.kernels.gemv") -> None:
    """batchrun's Triton kernels import (an install without them fails here, not mid-start)."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"batchrun's Triton kernels (batchrun.kernels) do not import ({e}); install batchrun "
            "(pip install ., or pip install -e . in a checkout) so that they are part of it"
        ) from e


def supports_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: sm_90 (Hopper) and later; older GPUs reject the launch
    attribute."""
    if device.type != "cuda":
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch.cuda.get_device_capability(index)[0] >= 9


def supports_fp8_matmul(device: torch.device) -> bool:
    """torch._scaled_mm's FP8 tensor cores: sm_89 (Ada) and later."""
    if device.type != "cuda":
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch.cuda.get_device_capability(index) >= (8, 9)


def supports_block_scaled_mm(device: torch.device) -> bool:
    """torch's scaled_mm with DeepSeek-style block scales (BlockWise1x128 activations,
    BlockWise128x128 weights): cuBLASLt's, on sm_90 with a torch built with CUDA 12.9+."""
    if device.type != "cuda" or not hasattr(torch.nn.functional, "ScalingType"):
        return False
    if tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2]) < (12, 9):
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch.cuda.get_device_capability(index) == (9, 0)


def supports_grouped_mm(device: torch.device) -> bool:
    """torch._grouped_mm on CUTLASS's grouped GEMM (bf16, no host sync): sm_90."""
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch.cuda.get_device_capability(index) == (9, 0)


def supports_int4_gemv_mma(device: torch.device) -> bool:
    """kernels/int4_gemv_mma.py: Triton with Gluon (it imports) and bf16 MMAs (sm_80+)."""
    if device.type != "cuda":
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    if torch.cuda.get_device_capability(index) < (8, 0):
        return False
    try:
        importlib.import_module("batchrun.kernels.int4_gemv_mma")
    except ImportError:
        return False
    return True


# a quantized model's weights are dequantized to bf16 at load where that takes at most this
# fraction of the GPU's memory (the rest: the KV pool and activations)
DEQUANT_MAX_MEMORY = 0.5
# int4_matmul "dequant-gemv" keeps the packed INT4 weight beside the bf16 one: a quarter of its
# bytes and the group scales and zeros (1/64 at group 128)
INT4_COPY = 0.27
# a quantized mixture of experts has no kernel for its experts: they run dequantized to bf16
# wherever the decoder's bf16 weights take at most this fraction of the GPU (gpt-oss-120b's
# 116 GB a rank at --tp 2 on an H200's 141 GiB leave about 20 GB to the KV pool)
EXPERTS_MAX_MEMORY = 0.85


def gpu_memory(device: torch.device) -> int:
    """The GPU's memory in bytes."""
    return torch.cuda.get_device_properties(device).total_memory


def bf16_weight_bytes(model_cfg, tp_size: int) -> int:
    """The bytes of one rank's decoder weights in bf16."""
    return 2 * decoder_params(model_cfg) // tp_size


def mxfp4_experts(model_cfg) -> bool:
    """Whether the checkpoint's experts are gpt-oss's MXFP4 (dequantized at load)."""
    return model_cfg.moe is not None and model_cfg.moe.mxfp4


def experts_too_large(model_cfg, tp_size: int, memory: int) -> str:
    """The refusal of a quantized mixture of experts whose dequantized weights do not fit."""
    need, share = bf16_weight_bytes(model_cfg, tp_size), EXPERTS_MAX_MEMORY * memory
    scheme = (
        "quantization_config mxfp4 (gpt-oss's experts)"
        if mxfp4_experts(model_cfg)
        else model_cfg.quantization.describe()
    )
    fits = next((tp for tp in (2, 4, 8, 16) if bf16_weight_bytes(model_cfg, tp) <= share), None)
    larger = (
        f"--tp {fits} ({bf16_weight_bytes(model_cfg, fits) / 1e9:.1f} GB a rank) fits"
        if fits is not None and fits > tp_size
        else "no --tp up to 16 fits"
    )
    return (
        f"{scheme}: a quantized mixture of experts runs its experts "
        f"dequantized to bf16, and the decoder's bf16 weights take {need / 1e9:.1f} GB a rank at "
        f"--tp {tp_size}, more than {EXPERTS_MAX_MEMORY:.0%} of this GPU's {memory / 1e9:.1f} GB "
        f"({share / 1e9:.1f} GB); {larger}"
    )


def _fa3_run_reason(config: EngineConfig, model_cfg, device: torch.device) -> str | None:
    """Why FlashInfer's FA3 prefill, available by fa3_unavailable_reason, still cannot run the
    model's attention: its one-batch start-up run (fa3_run_error, which builds the kernels on
    a machine's first run) failed. None: it ran."""
    dtype = torch.float16 if config.dtype == "float16" else torch.bfloat16  # "auto": bf16 (sm_90)
    tp = config.tp_size
    heads, kv_heads = model_cfg.num_heads // tp, max(1, model_cfg.num_kv_heads // tp)
    windows = model_cfg.sliding_windows or (0,)
    log.info(
        "running FlashInfer's FA3 prefill once (a machine's first run builds its kernels with "
        "nvcc: about 80 s on an H100, cached under ~/.cache/flashinfer; flashinfer-jit-cache "
        "ships them built)"
    )
    start = time.monotonic()
    error = fa3_run_error(device, heads, kv_heads, model_cfg.head_dim, dtype, windows)
    if error is None:
        log.info("FlashInfer's FA3 prefill ran in %.1f s", time.monotonic() - start)
        return None
    return f"FlashInfer's FA3 prefill failed on a {PROBE_TOKENS}-token batch ({error})"


def resolve_kernels(config: EngineConfig, model_cfg, device: torch.device) -> KernelConfig:
    """config.kernels with every auto field decided for `device` and the model. `config` has
    its sizes resolved (chunked_prefill_size) and its overlap decided."""
    want = config.kernels
    want.validate()
    cuda = device.type == "cuda"
    if config.kv_cache_dtype == "fp8_e4m3" and cuda and not supports_fp8_matmul(device):
        raise ValueError(
            "kv_cache_dtype 'fp8_e4m3' on CUDA needs an sm_89+ GPU (L40, H100, H200 or later), "
            "where the kernels convert float8; use kv_cache_dtype 'auto' on this GPU"
        )
    triton = has_triton()
    # a quantized checkpoint, or one quantized at load (--quantization)
    quantized = model_cfg.quantization is not None or config.quantization is not None
    # --quantization is "fp8"; a checkpoint's scheme says its family
    fp8_model = quantized and (
        model_cfg.quantization.family == "fp8" if model_cfg.quantization else True
    )

    attention = want.attention
    sinks = getattr(model_cfg, "attention_sinks", False)
    if sinks and attention == "flashinfer":
        raise ValueError(
            f"attention backend 'flashinfer' runs no attention sinks, which this model "
            f"({model_cfg.architecture}) has; use triton, torch or auto"
        )
    if attention == "auto":
        attention = "triton" if cuda and triton else "torch"
    elif attention == "triton" and not triton:
        raise ValueError("attention backend 'triton' needs the triton package; use torch or auto")
    elif attention == "flashinfer":
        reason = unavailable_reason(device)
        if reason is not None:
            raise ValueError(f"attention backend 'flashinfer' cannot run here: {reason}")

    extend_attention = want.extend_attention
    fa3_reason = "attention is not 'triton'"
    if attention == "triton" and extend_attention != "triton":
        fp8_kv = config.kv_cache_dtype == "fp8_e4m3"
        fa3_reason = fa3_unavailable_reason(
            device, model_cfg.max_head_dim, config.dtype, fp8_kv, sinks
        )
    if extend_attention == "auto":
        # FlashInfer's FA3 prefill reads a 16,384-token prefill at 546 TFLOP/s and 4,096 tokens
        # over a 126,976-token prefix at 554, where kernels/extend_attention.py reads 381 and
        # 371 (H100: `scripts/bench_attention_kernels.py --extend-cases
        # 1x16384,1x131072,1x4096+126976`); W5 on llama-8b runs 1.085x the Triton kernel's
        # total tok/s (H100: `scripts/bench_throughput.py --models llama-8b --workloads W5
        # --scale 0.125 --variants batchrun,extend-triton`)
        if fa3_reason is None:
            fa3_reason = _fa3_run_reason(config, model_cfg, device)
            if fa3_reason is not None:
                log.warning("the extend rows run on the Triton kernel: %s", fa3_reason)
        extend_attention = "triton" if fa3_reason else "fa3"
    elif extend_attention == "fa3":
        if attention != "triton":
            raise ValueError(
                f"extend_attention 'fa3' runs attention 'triton''s extend rows, and the attention "
                f"backend is {attention!r}; use extend_attention 'triton' or 'auto'"
            )
        if fa3_reason is None:
            fa3_reason = _fa3_run_reason(config, model_cfg, device)
        if fa3_reason is not None:
            raise ValueError(f"extend_attention 'fa3' cannot run here: {fa3_reason}")

    triton_ops = want.triton_ops
    if triton_ops is None:
        triton_ops = cuda and triton
    elif triton_ops and not triton:
        raise ValueError("triton_ops needs the triton package")

    pdl = want.pdl
    if pdl is None:
        pdl = triton_ops and supports_pdl(device)
    elif pdl and not (triton_ops and supports_pdl(device)):
        raise ValueError("pdl needs the Triton kernels on an sm_90+ GPU (H100, H200 or later)")

    decode_gemv = want.decode_gemv
    if decode_gemv == "auto":
        # NOTE: the Triton matmuls pay only with PDL: without it they read W3 llama-1b 1.28 ms
        # per token against cuBLAS's 1.16 on the H200. A per-channel FP8 model's decode batches
        # run on kernels/fp8_gemv.py: llama-8b W3 3.05 ms per token against 5.05 on
        # torch._scaled_mm (bf16: 4.12; `scripts/bench_throughput.py --models llama-8b
        # --workloads W3 --variants batchrun,fp8,fp8-gemv`)
        decode_gemv = "triton" if pdl else "cublas"
    elif decode_gemv == "triton" and not triton:
        raise ValueError("decode_gemv 'triton' needs the triton package")

    fp8_block_gemm = want.fp8_block_gemm
    if fp8_block_gemm == "auto":
        fp8_block_gemm = "cublaslt" if supports_block_scaled_mm(device) else "triton"
    elif fp8_block_gemm == "cublaslt" and not supports_block_scaled_mm(device):
        raise ValueError(
            "fp8_block_gemm 'cublaslt' needs an sm_90 GPU (H100, H200) and a torch built with "
            "CUDA 12.9 or later (torch.nn.functional.scaled_mm's block scales); use 'triton' "
            "or 'auto'"
        )

    # NOTE: block FP8 on cuBLASLt's block-scaled matmul runs faster than bf16; on the Triton
    # block matmul it runs slower, so where the bf16 weights fit it is dequantized at load
    # unless cuBLASLt runs. One H100, llama-8b, same run (`scripts/bench_throughput.py --models
    # llama-8b --workloads W1,W3 --variants batchrun,fp8-block-kv-fp8,fp8-block`): cuBLASLt's
    # W1 10,246 output tok/s and W3 3.70 ms per token against bf16's 9,666 and 5.30 (15,312
    # with the FP8 KV cache); the Triton kernel's W1 9,116 and W3 5.70 against bf16's 11,119 and
    # 4.08 (H200, `--variants batchrun,fp8-block` at 1e6ccd4). The kernels keep such a model's
    # weights in a half (FP8) or a quarter (INT4) of the bytes: they run where the dequantized
    # weights would take more than DEQUANT_MAX_MEMORY
    need = bf16_weight_bytes(model_cfg, config.tp_size) if cuda else 0
    memory = gpu_memory(device) if cuda else 0
    dequant_fits = not cuda or need <= DEQUANT_MAX_MEMORY * memory
    dequant_experts = has_quantized_experts(model_cfg) or mxfp4_experts(model_cfg)
    if cuda and dequant_experts and need > EXPERTS_MAX_MEMORY * memory:
        raise ValueError(experts_too_large(model_cfg, config.tp_size, memory))
    blocks = model_cfg.quantization is not None and model_cfg.quantization.block is not None
    fp8_matmul = want.fp8_matmul
    if fp8_matmul == "auto":
        fp8_matmul = "scaled_mm" if supports_fp8_matmul(device) else "dequant"
        if blocks and dequant_fits and fp8_block_gemm != "cublaslt":
            fp8_matmul = "dequant"
    elif fp8_matmul == "scaled_mm" and not supports_fp8_matmul(device):
        raise ValueError(
            "fp8_matmul 'scaled_mm' needs the FP8 tensor cores of an sm_89+ GPU (L40, H100, "
            "H200 or later); use 'dequant' or 'auto'"
        )

    # NOTE: an INT4 model whose bf16 weights fit decodes its batches of up to 16 rows on the
    # packed weight (kernels/int4_gemv_mma.py) and the rest on the bf16 one: one H100,
    # llama-8b AWQ (`scripts/bench_throughput.py --models llama-8b --variants
    # batchrun,int4-awq,int4-awq-auto`), W3 2.73 ms per token against bf16's 5.41 (the packed
    # weight alone: 2.80) and W1 x0.25 10,919 output tok/s against 10,268, where the tiled
    # W4A16 matmul alone runs W1 at half bf16's throughput
    int4_matmul = want.int4_matmul
    gemv_mma = cuda and triton and supports_int4_gemv_mma(device)
    int4_model = model_cfg.quantization is not None and model_cfg.quantization.family == "int4"
    if int4_matmul == "auto":
        int4_matmul = "dequant"
        if cuda and triton and not dequant_fits:
            int4_matmul = "triton"
        elif int4_model and gemv_mma and need * (1 + INT4_COPY) <= DEQUANT_MAX_MEMORY * memory:
            int4_matmul = "dequant-gemv"
    elif int4_matmul == "triton" and not triton:
        raise ValueError(
            "int4_matmul 'triton' (kernels/int4_matmul.py) needs the triton package; use "
            "'dequant' or 'auto'"
        )
    elif int4_matmul == "dequant-gemv" and not gemv_mma:
        raise ValueError(
            "int4_matmul 'dequant-gemv' (kernels/int4_gemv_mma.py) needs an sm_80+ GPU and "
            "Triton with Gluon (triton.experimental.gluon, 3.5 or later); use 'dequant' or "
            "'auto'"
        )

    moe = want.moe
    own_experts = model_cfg.moe is not None and model_cfg.moe.act != "silu"
    if own_experts and moe == "triton":
        raise ValueError(
            f"moe 'triton' (kernels/fused_moe.py) runs SiLU experts, and this model's are "
            f"{model_cfg.moe.act}; use moe 'torch' or 'auto'"
        )
    if moe == "auto":
        moe = "triton" if cuda and triton and not own_experts else "torch"
    elif moe == "triton" and not triton:
        raise ValueError(
            "moe 'triton' (kernels/fused_moe.py) needs the triton package; use 'torch' or 'auto'"
        )

    moe_decode = want.moe_decode
    if moe_decode == "auto":
        # NOTE: kernels/moe_gemv.py's GEMVs (and the router in one kernel) read Qwen3-30B-A3B's
        # W3 at 3.90 ms per token against 4.53 on the grouped GEMMs (H100, one run:
        # `scripts/bench_throughput.py --models qwen3-30b-a3b --workloads W3 --variants
        # batchrun,moe-grouped`); its `takes_gemv` says which decode batches take them
        moe_decode = "gemv" if moe == "triton" else "grouped"
    elif moe_decode == "gemv" and moe != "triton":
        raise ValueError(
            "moe_decode 'gemv' (kernels/moe_gemv.py) runs the fused experts' decode batches: it "
            "needs moe 'triton'; use 'grouped' or 'auto'"
        )

    moe_prefill = want.moe_prefill
    bf16 = config.dtype in ("auto", "bfloat16")
    grouped_mm = supports_grouped_mm(device) and bf16
    if moe_prefill == "auto":
        # NOTE: on one H100 (`python scripts/bench_fused_moe.py --models qwen3-30b-a3b,mixtral-8x7b
        # --tokens 1024,4096,16384`) Qwen3-30B-A3B's experts take 957 µs at 4,096 tokens on it
        # against 1,037 on the Triton grouped GEMMs; Mixtral's, 1,867 against 2,010 at 1,024 and
        # slower past it, where its pass (h's bound) is shorter than fused_moe's: its rule,
        # takes_grouped_mm, keeps those on the Triton GEMMs
        moe_prefill = "grouped_mm" if moe == "triton" and grouped_mm else "triton"
    elif moe_prefill == "grouped_mm" and (moe != "triton" or (cuda and not grouped_mm)):
        raise ValueError(
            "moe_prefill 'grouped_mm' (kernels/moe_grouped_mm.py) runs with moe 'triton' and, on "
            "CUDA, bf16 on an sm_90 GPU (CUTLASS's grouped GEMM behind torch._grouped_mm); use "
            "'triton' or 'auto'"
        )

    decode_norms = resolve_decode_norms(
        want.decode_norms, model_cfg, tp_size=config.tp_size, decode_gemv=decode_gemv,
        quantized=quantized, fp8_kept=fp8_model and fp8_matmul == "scaled_mm", moe=moe,
        moe_decode=moe_decode,
    )  # fmt: skip

    graphs = want.cuda_graph_max_bs if cuda else 0
    piecewise = want.piecewise_graphs
    runs_piecewise = cuda and isinstance(config.chunked_prefill_size, int)
    if piecewise and model_cfg.whole_forward:
        raise ValueError(
            f"piecewise CUDA graphs split the forward at its attentions, and "
            f"{model_cfg.architecture} runs its forward whole; use piecewise_graphs off or auto"
        )
    runs_piecewise = runs_piecewise and not model_cfg.whole_forward
    if piecewise and not runs_piecewise:
        raise ValueError(
            "piecewise CUDA graphs need CUDA and a chunked prefill size (a step's tokens bounded)"
        )
    if not runs_piecewise:
        piecewise = False
    elif piecewise is None:
        # NOTE: on by default only where the host is the bottleneck: a small model's mixed steps
        # (a large one's GPU time hides their launches, and the padding to a captured size costs).
        # A mixture of experts takes them when asked: its padded rows each run top_k experts
        piecewise = graphs > 0 and not is_large(model_cfg) and model_cfg.moe is None

    if model_cfg.moe is not None and moe == "torch" and (graphs or piecewise):
        raise ValueError(
            "moe 'torch' reads the routing on the host, which a CUDA graph cannot capture; use "
            "moe 'triton' or 'auto', or no CUDA graphs (cuda_graph_max_bs 0, piecewise_graphs "
            "off)"
        )

    host_gate = want.host_gate
    available = cuda and bool(config.overlap) and HostGate.available()
    if host_gate is None:
        host_gate = available
    elif host_gate and not available:
        raise ValueError(
            "host_gate needs CUDA, overlap and a driver with stream memory operations "
            "(cuStreamWaitValue32)"
        )

    fp8_kernels = quantized and fp8_matmul == "scaled_mm" and triton  # kernels/fp8_*.py
    uses_triton = attention == "triton" or fp8_kernels or int4_matmul in ("triton", "dequant-gemv")
    fused_moe = model_cfg.moe is not None and moe == "triton"
    if triton_ops or decode_gemv == "triton" or uses_triton or fused_moe:
        _check_kernels_import()
    if fused_moe:
        _check_kernels_import("batchrun.kernels.fused_moe")
        if moe_decode == "gemv":
            _check_kernels_import("batchrun.kernels.moe_gemv")
        if moe_prefill == "grouped_mm":
            _check_kernels_import("batchrun.kernels.moe_grouped_mm")
    return replace(
        want,
        attention=attention,
        extend_attention=extend_attention,
        triton_ops=triton_ops,
        pdl=pdl,
        decode_gemv=decode_gemv,
        decode_norms=decode_norms,
        cuda_graph_max_bs=graphs,
        piecewise_graphs=piecewise,
        host_gate=host_gate,
        fp8_matmul=fp8_matmul,
        fp8_block_gemm=fp8_block_gemm,
        int4_matmul=int4_matmul,
        moe=moe,
        moe_decode=moe_decode,
        moe_prefill=moe_prefill,
    )
