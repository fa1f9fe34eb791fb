"""The kernel plan an engine runs (batchrun/config.py's KernelPlan says what each field is),
resolved once at start-up from the user's choices (EngineConfig), the device, the torch build
and the model, by one rule a family:

    plan = resolve_kernels(config, model_cfg, device)            # every field concrete
    plan = resolve_kernels(config, model_cfg, device, KernelPlan(moe_decode="grouped"))
                                                                 # a benchmark's override

    attention_rule   attention, extend_attention
    dense_rule       triton_ops, pdl, decode_gemv
    fp8_rule         fp8_matmul, fp8_fast_accum
    int4_rule        int4_matmul
    moe_rule         moe, moe_decode, moe_prefill
    graph_rule       cuda_graph_max_bs, piecewise_graphs, host_gate
    compile_rule     compile_workers
    per_layer_table_rule  per_layer_table
    linear_rule      linear_attention
    (decode_norms: its rule in resolve_kernels)

A field the override sets is kept, or refused with a message when it cannot run here. Nothing
here is read again on the step path: every block is built with the plan.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import fields, replace

import torch

from batchrun.attention import fa3_cache
from batchrun.config import EngineConfig, KernelPlan, is_large
from batchrun.engine.device_support import (
    _check_kernels_import,
    has_triton,
    supports_block_scaled_mm,
    supports_fp8_matmul,
    supports_grouped_mm,
    supports_int4_gemv_mma,
    supports_pdl,
)
from batchrun.engine.host_gate import HostGate
from batchrun.engine.weight_memory import (
    DEQUANT_MAX_MEMORY,
    EXPERTS_MAX_MEMORY,
    INT4_COPY,
    bf16_weight_bytes,
    experts_too_large,
    mxfp4_experts,
)
from batchrun.models.fused_decode import resolve_mode as resolve_decode_norms
from batchrun.models.moe_config import FUSED_ACTS
from batchrun.models.moe_weights import has_quantized_experts

log = logging.getLogger(__name__)

# the start-up compile pool's size at most: the decode graphs of a dense model meet about twenty
# Triton variants, so more processes would mostly import torch (docs/benchmarks.md, Start-up)
MAX_COMPILE_WORKERS = 8


def gpu_memory(device: torch.device) -> int:
    """The GPU's memory in bytes."""
    return torch.cuda.get_device_properties(device).total_memory


def dequant_fits(config: EngineConfig, model_cfg, device, factor: float = 1.0) -> bool:
    """Whether the decoder's bf16 weights (times `factor`) take at most DEQUANT_MAX_MEMORY of
    the GPU (the CPU: always)."""
    if device.type != "cuda":
        return True
    need = bf16_weight_bytes(model_cfg, config.tp_size) * factor
    return need <= DEQUANT_MAX_MEMORY * gpu_memory(device)


BLOCK_SCALED_MM = (
    "runs 128 x 128 block-FP8 weights on cuBLASLt's block-scaled matmul, which needs an sm_90 GPU "
    "(H100, H200) and a torch built with CUDA 12.9 or later (torch.nn.functional.scaled_mm's "
    "block scales)"
)


def block_fp8_too_large(config: EngineConfig, model_cfg, device) -> str:
    """The refusal of a block-FP8 model where cuBLASLt's block matmul is missing and its
    dequantized weights do not fit."""
    need = bf16_weight_bytes(model_cfg, config.tp_size)
    share = DEQUANT_MAX_MEMORY * gpu_memory(device)
    return (
        f"{model_cfg.quantization.describe()}: batchrun {BLOCK_SCALED_MM}, and is missing "
        f"here; dequantized, the decoder's bf16 weights take {need / 1e9:.1f} GB a rank at --tp "
        f"{config.tp_size}, more than {DEQUANT_MAX_MEMORY:.0%} of this GPU's memory "
        f"({share / 1e9:.1f} GB); run it on an H100 / H200 with such a torch, or at a larger --tp"
    )


def fa3_extend_reason(config: EngineConfig, model_cfg, device: torch.device) -> str | None:
    """Why the extend rows do not run on FlashInfer's FA3 prefill here (None: they do). The rule:
    FA3 where it runs the model (fa3_cache.unavailable_reason) and its kernels are built already
    (flashinfer-jit-cache, or flashinfer's JIT cache from an earlier run), and its one-batch
    start-up run passes; where they are not built and nvcc is here, a detached process builds
    them for the next run (rank 0 only), and this run keeps the Triton extend kernel: no compiler
    on the start-up path (docs/benchmarks.md, Start-up)."""
    if len(set(model_cfg.layer_head_dims)) > 1 or len(set(model_cfg.layer_kv_heads)) > 1:
        return "its layers differ in head dim or KV heads, and FA3's prefill runs one shape"
    sinks = getattr(model_cfg, "attention_sinks", False)
    fp8_kv = config.kv_cache_dtype == "fp8_e4m3"
    reason = fa3_cache.unavailable_reason(device, model_cfg.head_dim, config.dtype, fp8_kv, sinks)
    if reason is not None:
        return reason
    dtype = fa3_cache.torch_dtype(config.dtype)
    windows = model_cfg.sliding_windows or (0,)
    try:
        missing = fa3_cache.missing_modules(model_cfg.head_dim, dtype, windows)
    except (ImportError, AttributeError) as e:  # a flashinfer without 0.6's JIT layout
        return f"this flashinfer does not say where its JIT modules are ({e})"
    if missing:
        if fa3_cache.find_nvcc() is None:
            return (
                f"its kernels ({', '.join(missing)}) are not built here, and no nvcc is here to "
                "build them (install flashinfer-jit-cache for this flashinfer and CUDA)"
            )
        if config.tp_rank == 0:
            log_path = fa3_cache.start_build(model_cfg.head_dim, dtype, windows)
            return (
                "its kernels are not built here yet; a background process builds them for the "
                f"next run on this machine (log: {log_path})"
            )
        return "its kernels are not built here yet (rank 0 builds them)"
    tp = config.tp_size
    heads, kv_heads = model_cfg.num_heads // tp, max(1, model_cfg.num_kv_heads // tp)
    start = time.monotonic()
    error = fa3_cache.probe_error(device, heads, kv_heads, model_cfg.head_dim, dtype, windows)
    if error is not None:
        tokens = fa3_cache.PROBE_TOKENS
        return f"FlashInfer's FA3 prefill failed on a {tokens}-token batch ({error})"
    log.info("FlashInfer's FA3 prefill ran its start-up batch in %.1f s", time.monotonic() - start)
    return None


def attention_rule(config: EngineConfig, model_cfg, device, want: KernelPlan, triton: bool):
    """(attention, extend_attention): the Triton kernels on CUDA where Triton imports, else
    torch; the extend rows on FA3 where fa3_extend_reason finds nothing against it."""
    cuda = device.type == "cuda"
    attention = want.attention
    if attention == "auto":
        attention = "triton" if cuda and triton else "torch"
    elif attention == "triton" and not triton:
        raise ValueError("attention backend 'triton' needs the triton package; use torch or auto")
    extend_attention = want.extend_attention
    if extend_attention == "auto":
        extend_attention = "triton"
        if attention == "triton":
            reason = fa3_extend_reason(config, model_cfg, device)
            if reason is None:
                extend_attention = "fa3"
            else:
                log.info("the extend rows run on the Triton kernel, not FA3: %s", reason)
    elif extend_attention == "fa3":
        if attention != "triton":
            raise ValueError(
                f"extend_attention 'fa3' runs attention 'triton''s extend rows, and the attention "
                f"backend is {attention!r}; use extend_attention 'triton' or 'auto'"
            )
        reason = fa3_extend_reason(config, model_cfg, device)
        if reason is not None:
            raise ValueError(f"extend_attention 'fa3' cannot run here: {reason}")
    return attention, extend_attention


def dense_rule(config: EngineConfig, device, want: KernelPlan, triton: bool):
    """(triton_ops, pdl, decode_gemv): the small Triton kernels on CUDA where Triton imports;
    PDL on sm_90+ unless the user turned it off; the decode matmuls on kernels/gemv.py only with
    PDL (docs/benchmarks.md, Kernels: Decode GEMV)."""
    cuda = device.type == "cuda"
    triton_ops = want.triton_ops
    if triton_ops is None:
        triton_ops = cuda and triton
    elif triton_ops and not triton:
        raise ValueError("triton_ops needs the triton package")
    pdl = want.pdl
    if pdl is None:
        pdl = config.pdl and triton_ops and supports_pdl(device)
    elif pdl and not (triton_ops and supports_pdl(device)):
        raise ValueError("pdl needs the Triton kernels on an sm_90+ GPU (H100, H200 or later)")
    decode_gemv = want.decode_gemv
    if decode_gemv == "auto":
        decode_gemv = "triton" if pdl else "cublas"
    elif decode_gemv == "triton" and not triton:
        raise ValueError("decode_gemv 'triton' needs the triton package")
    return triton_ops, pdl, decode_gemv


def fp8_rule(config: EngineConfig, model_cfg, device, want: KernelPlan):
    """(fp8_matmul, fp8_fast_accum): FP8 weights kept on the FP8 tensor cores (sm_89+) unless
    the user dequantizes; 128 x 128 blocks only on cuBLASLt's block-scaled matmul (a torch
    built with CUDA 12.9+ on sm_90), dequantized where it is missing and the bf16 weights fit
    DEQUANT_MAX_MEMORY, else refused; fast accumulation on (docs/benchmarks.md, Quantized
    models)."""
    cuda = device.type == "cuda"
    blocks = model_cfg.quantization is not None and model_cfg.quantization.block is not None
    fp8_matmul = want.fp8_matmul
    if fp8_matmul == "auto":
        keep = cuda and supports_fp8_matmul(device) and not config.dequantize
        fp8_matmul = "scaled_mm" if keep else "dequant"
        if keep and blocks and not supports_block_scaled_mm(device):
            if not dequant_fits(config, model_cfg, device):
                raise ValueError(block_fp8_too_large(config, model_cfg, device))
            fp8_matmul = "dequant"
    elif fp8_matmul == "scaled_mm":
        if not supports_fp8_matmul(device):
            raise ValueError(
                "fp8_matmul 'scaled_mm' needs the FP8 tensor cores of an sm_89+ GPU (L40, H100, "
                "H200 or later); use 'dequant' or 'auto'"
            )
        if blocks and not supports_block_scaled_mm(device):
            raise ValueError(f"fp8_matmul 'scaled_mm' {BLOCK_SCALED_MM}; use 'dequant' or 'auto'")
    fast_accum = True if want.fp8_fast_accum is None else want.fp8_fast_accum
    return fp8_matmul, fast_accum


def int4_rule(config: EngineConfig, model_cfg, device, want: KernelPlan, triton: bool) -> str:
    """int4_matmul: an INT4 model whose bf16 weights and packed copy fit DEQUANT_MAX_MEMORY
    decodes its batches of up to 16 rows on the packed weight (kernels/int4_gemv_mma.py) and
    the rest on the bf16 one ("dequant-gemv"); one whose bf16 weights do not fit runs the packed
    weights ("triton"); elsewhere, or where the user dequantizes, "dequant" (docs/benchmarks.md,
    Quantized models)."""
    cuda = device.type == "cuda"
    int4_matmul = want.int4_matmul
    gemv_mma = cuda and triton and supports_int4_gemv_mma(device)
    int4_model = model_cfg.quantization is not None and model_cfg.quantization.family == "int4"
    if int4_matmul == "auto":
        int4_matmul = "dequant"
        if config.dequantize:
            pass
        elif cuda and triton and not dequant_fits(config, model_cfg, device):
            int4_matmul = "triton"
        elif int4_model and gemv_mma and dequant_fits(config, model_cfg, device, 1 + INT4_COPY):
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
    return int4_matmul


def moe_rule(config: EngineConfig, model_cfg, device, want: KernelPlan, triton: bool):
    """(moe, moe_decode, moe_prefill): the fused Triton experts on CUDA where Triton imports;
    their decode batches on kernels/moe_gemv.py's GEMVs; their large batches on
    torch._grouped_mm for bf16 on sm_90 (kernels/moe_grouped_mm.py's `takes_grouped_mm` keeps
    the shapes it loses on the Triton GEMMs; docs/benchmarks.md, Other architectures: MoE)."""
    cuda = device.type == "cuda"
    moe = want.moe
    own_experts = model_cfg.moe is not None and model_cfg.moe.act not in FUSED_ACTS
    if own_experts and moe == "triton":
        raise ValueError(
            f"moe 'triton' (kernels/fused_moe.py) runs experts gated by {FUSED_ACTS}, and this "
            f"model's are {model_cfg.moe.act}; use moe 'torch' or 'auto'"
        )
    if moe == "auto":
        moe = "triton" if cuda and triton and not own_experts else "torch"
    elif moe == "triton" and not triton:
        raise ValueError(
            "moe 'triton' (kernels/fused_moe.py) needs the triton package; use 'torch' or 'auto'"
        )
    moe_decode = want.moe_decode
    if moe_decode == "auto":
        moe_decode = "gemv" if moe == "triton" else "grouped"
    elif moe_decode == "gemv" and moe != "triton":
        raise ValueError(
            "moe_decode 'gemv' (kernels/moe_gemv.py) runs the fused experts' decode batches: it "
            "needs moe 'triton'; use 'grouped' or 'auto'"
        )
    moe_prefill = want.moe_prefill
    grouped_mm = supports_grouped_mm(device) and config.dtype in ("auto", "bfloat16")
    if moe_prefill == "auto":
        moe_prefill = "grouped_mm" if moe == "triton" and grouped_mm else "triton"
    elif moe_prefill == "grouped_mm" and (moe != "triton" or (cuda and not grouped_mm)):
        raise ValueError(
            "moe_prefill 'grouped_mm' (kernels/moe_grouped_mm.py) runs with moe 'triton' and, on "
            "CUDA, bf16 on an sm_90 GPU (CUTLASS's grouped GEMM behind torch._grouped_mm); use "
            "'triton' or 'auto'"
        )
    return moe, moe_decode, moe_prefill


# a per-layer table of more than this share of the GPU's memory goes to pinned host memory,
# the GPU memory it leaves going to KV (docs/benchmarks.md, Gemma 4: the per-layer table)
HOST_TABLE_SHARE = 1 / 16


def per_layer_table_rule(config: EngineConfig, model_cfg, device, want: KernelPlan, triton: bool):
    """per_layer_table: "host" on CUDA with Triton where the table (ModelConfig.
    host_table_elements) is larger than HOST_TABLE_SHARE of the GPU's memory, else "device"."""
    table, elements = want.per_layer_table, model_cfg.host_table_elements
    cuda = device.type == "cuda"
    if table == "host" and not (elements and cuda and triton):
        raise ValueError(
            "per_layer_table 'host' keeps a per-layer embedding table (Gemma 4's E-models) in "
            "pinned host memory read by the GPU (kernels/host_gather.py): it needs such a table, "
            "CUDA and the triton package; use 'device' or 'auto'"
        )
    if table == "auto":
        nbytes = elements * (4 if config.dtype == "float32" else 2)
        big = cuda and elements > 0 and nbytes > gpu_memory(device) * HOST_TABLE_SHARE
        table = "host" if big and triton else "device"
    return table


def has_fla() -> bool:
    """Whether fla-core's Gated DeltaNet kernels import (they need Triton)."""
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def linear_rule(model_cfg, device, want: KernelPlan, triton: bool) -> str:
    """linear_attention: a hybrid model's Gated DeltaNet layers on fla-core's kernels (and
    kernels/causal_conv1d.py) on CUDA where Triton and fla-core import; plain torch elsewhere
    and for a model without linear-attention layers."""
    hybrid = getattr(model_cfg, "linear_attention", None) is not None
    linear = want.linear_attention
    usable = device.type == "cuda" and triton
    if linear == "auto":
        return "fla" if hybrid and usable and has_fla() else "torch"
    if linear == "fla" and not (usable and has_fla()):
        raise ValueError(
            "linear_attention 'fla' runs fla-core's Triton kernels on a CUDA GPU: it needs CUDA, "
            "the triton package and fla-core (pip install fla-core); use 'torch' or 'auto'"
        )
    return linear


def graph_rule(config: EngineConfig, model_cfg, device, want: KernelPlan):
    """(cuda_graph_max_bs, piecewise_graphs, host_gate): decode graphs up to the user's batch
    on CUDA; piecewise graphs where the host is the bottleneck, a small model's mixed steps (a
    large one's GPU time hides their launches, and the padding to a captured size costs; a
    mixture of experts' padded rows each run top_k experts) and the user left them on; the host
    gate where overlap runs and the driver has stream memory operations."""
    cuda = device.type == "cuda"
    graphs = config.cuda_graph_max_bs if want.cuda_graph_max_bs is None else want.cuda_graph_max_bs
    graphs = graphs if cuda else 0
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
        small = not is_large(model_cfg) and model_cfg.moe is None
        piecewise = config.piecewise_graphs and graphs > 0 and small
    host_gate = want.host_gate
    available = cuda and bool(config.overlap) and HostGate.available()
    if host_gate is None:
        host_gate = config.host_gate and available
    elif host_gate and not available:
        raise ValueError(
            "host_gate needs CUDA, overlap and a driver with stream memory operations "
            "(cuStreamWaitValue32)"
        )
    return graphs, piecewise, host_gate


def compile_rule(
    want: KernelPlan, model_cfg, tp_size: int, graphs: int, triton_kernels: bool
) -> int:
    """compile_workers: where decode graphs are captured over Triton kernels for a model
    without experts or linear attention, half the CPUs this process may use shared by the
    tensor-parallel ranks (at most MAX_COMPILE_WORKERS a rank), if that is at least two and this
    Triton has the hooks engine/precompile.py needs; else 0 (docs/benchmarks.md, Start-up).
    Experts are left out because their routing kernels' outputs feed index arithmetic, which
    the dry pass would run on what skipped kernels left behind; linear attention because
    fla-core's autotuned kernels time their launches."""
    if want.compile_workers is not None:
        if want.compile_workers < 0:
            raise ValueError(f"compile_workers must be 0 or more; got {want.compile_workers}")
        return want.compile_workers
    if not graphs or not triton_kernels:
        return 0
    if model_cfg.moe is not None or model_cfg.linear_attention is not None:
        return 0
    from batchrun.engine import precompile

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = min(MAX_COMPILE_WORKERS, (cpus or 1) // (2 * tp_size))
    return workers if workers >= 2 and precompile.supported() else 0


def resolve_kernels(
    config: EngineConfig, model_cfg, device: torch.device, want: KernelPlan | None = None
) -> KernelPlan:
    """The plan for `device` and the model: `want`'s fields where set (checked), the rules'
    elsewhere. `config` has its sizes resolved (chunked_prefill_size) and its overlap decided;
    with config.reference_kernels every field `want` leaves is the reference's."""
    want = want or KernelPlan()
    want.validate()
    if config.reference_kernels:
        chosen = {f.name: getattr(want, f.name) for f in fields(want)}
        reference = KernelPlan.reference()
        want = replace(want, **{
            name: getattr(reference, name) for name, value in chosen.items()
            if value in ("auto", None)
        })  # fmt: skip
    cuda = device.type == "cuda"
    if config.kv_cache_dtype == "fp8_e4m3" and cuda and not supports_fp8_matmul(device):
        raise ValueError(
            "kv_cache_dtype 'fp8_e4m3' on CUDA needs an sm_89+ GPU (L40, H100, H200 or later), "
            "where the kernels convert float8; use kv_cache_dtype 'auto' on this GPU"
        )
    triton = has_triton()
    # a quantized checkpoint, or one quantized at load (--quantization)
    quantized = model_cfg.quantization is not None or config.quantization is not None
    if cuda and (has_quantized_experts(model_cfg) or mxfp4_experts(model_cfg)):
        memory = gpu_memory(device)
        if bf16_weight_bytes(model_cfg, config.tp_size) > EXPERTS_MAX_MEMORY * memory:
            raise ValueError(experts_too_large(model_cfg, config.tp_size, memory))

    attention, extend_attention = attention_rule(config, model_cfg, device, want, triton)
    triton_ops, pdl, decode_gemv = dense_rule(config, device, want, triton)
    fp8_matmul, fp8_fast_accum = fp8_rule(config, model_cfg, device, want)
    int4_matmul = int4_rule(config, model_cfg, device, want, triton)
    moe, moe_decode, moe_prefill = moe_rule(config, model_cfg, device, want, triton)
    graphs, piecewise, host_gate = graph_rule(config, model_cfg, device, want)
    compile_workers = compile_rule(
        want, model_cfg, config.tp_size, graphs, triton_ops or decode_gemv == "triton"
    )
    per_layer_table = per_layer_table_rule(config, model_cfg, device, want, triton)
    linear_attention = linear_rule(model_cfg, device, want, triton)

    decode_norms = resolve_decode_norms(
        want.decode_norms, model_cfg, tp_size=config.tp_size, decode_gemv=decode_gemv,
        quantized=quantized, moe=moe,
        moe_decode=moe_decode,
    )  # fmt: skip

    if model_cfg.moe is not None and moe == "torch" and (graphs or piecewise):
        raise ValueError(
            "moe 'torch' reads the routing on the host, which a CUDA graph cannot capture; use "
            "moe 'triton' or 'auto', or no CUDA graphs (cuda_graph_max_bs 0, piecewise_graphs "
            "off)"
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
    if per_layer_table == "host":
        _check_kernels_import("batchrun.kernels.host_gather")
    if linear_attention == "fla":
        _check_kernels_import("batchrun.kernels.causal_conv1d")
    return KernelPlan(
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
        int4_matmul=int4_matmul,
        fp8_fast_accum=fp8_fast_accum,
        moe=moe,
        moe_decode=moe_decode,
        moe_prefill=moe_prefill,
        compile_workers=compile_workers,
        per_layer_table=per_layer_table,
        linear_attention=linear_attention,
    )
