"""Engine configuration: EngineConfig, with the GPU path's kernel choices in KernelConfig.

Both are frozen (build a new one with dataclasses.replace). Fields left at "auto" / None are
resolved once, when the engine starts: the step sizes by `resolve_sizes`, the kernels by
`engine/kernel_choice.py` from the device, the GPU's capability and the model's shape. The
resolved KernelConfig is logged at start-up and written into a run's manifest.json.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
DUMMY_INITS = ("normal", "uniform")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
# attention "triton"'s prefill and mixed steps: "triton" kernels/extend_attention.py, "fa3"
# FlashInfer's FlashAttention-3 paged prefill (Hopper) on the steps' extend rows
EXTEND_ATTENTIONS = ("auto", "triton", "fa3")
DECODE_GEMVS = ("auto", "cublas", "triton")
# how a one-row decode step on kernels/gemv.py runs the residual adds and RMSNorms between its
# matmuls (models/fused_decode.py): "off" kernels of their own; "all" each inside the matmul
# before it (o_proj, down_proj); "fold-all" inside the matmul after them (qkv's, gate_up's)
DECODE_NORMS = ("auto", "off", "all", "fold-all")
# the matmul of a quantized model's FP8 linears: "scaled_mm" the FP8 tensor cores (sm_89+;
# per tensor / channel torch._scaled_mm, 128 x 128 blocks as FP8_BLOCK_GEMMS picks), "dequant"
# weights dequantized at load
FP8_MATMULS = ("auto", "scaled_mm", "dequant")
# the matmul of a 128 x 128 block-FP8 linear kept in FP8, above the decode GEMV's 16 rows:
# "cublaslt" torch's scaled_mm with BlockWise1x128 activations and BlockWise128x128 weights
# (cuBLASLt; sm_90 and a torch built with CUDA 12.9+), "triton" kernels/fp8_block_matmul.py
FP8_BLOCK_GEMMS = ("auto", "cublaslt", "triton")
# the matmul of a quantized model's INT4 linears (AWQ, GPTQ, compressed-tensors W4A16): "triton"
# kernels/int4_matmul.py on the packed weights (decode batches of up to 16 rows on
# kernels/int4_gemv_mma.py, or kernels/int4_gemv.py where that does not take the weight),
# "dequant" weights dequantized at load, "dequant-gemv" dequantized and also kept packed for
# kernels/int4_gemv_mma.py's decode batches (batchrun/quant/linear.py's "int4_dense")
INT4_MATMULS = ("auto", "triton", "dequant", "dequant-gemv")
# the experts of a mixture-of-experts model (layers/moe.py): "triton" kernels/fused_moe.py,
# "torch" a per-expert loop that reads the routing on the host (the reference)
MOE_BACKENDS = ("auto", "triton", "torch")
# the fused experts' decode batches (of at most kernels/moe_gemv.py's MAX_ROWS routed rows):
# "gemv" the router in one kernel (kernels/moe_route.py's route_gemv) and the experts on
# kernels/moe_gemv.py, "grouped" as every other batch (kernels/fused_moe.py's grouped GEMMs)
MOE_DECODES = ("auto", "grouped", "gemv")
# the fused experts' batches past 32 routed rows an expert (kernels/fused_moe.py's pick_config
# gathers those): "triton" kernels/fused_moe.py's grouped GEMMs, "grouped_mm" torch._grouped_mm
# (CUTLASS's grouped GEMM on sm_90) with kernels/moe_grouped_mm.py's gather, SwiGLU and sum
MOE_PREFILLS = ("auto", "triton", "grouped_mm")
QUANTIZATIONS = ("fp8",)  # EngineConfig.quantization: a bf16 checkpoint quantized at load
# EngineConfig.kv_cache_dtype: "auto" the compute dtype; "fp8_e4m3" float8_e4m3fn with the
# checkpoint's per-layer k/v scales (else 1.0), one byte an element (batchrun/quant/kv_cache.py)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")

# on CUDA the KV pool takes this fraction of the GPU memory free once the weights are loaded
# (EngineConfig.gpu_memory_utilization); the rest is for activations, CUDA graphs and kernels
GPU_MEMORY_UTILIZATION = 0.85

# the defaults of max_running (None) and chunked_prefill_size ("auto"): auto_sizes
MAX_RUNNING, MAX_RUNNING_CUDA, MAX_RUNNING_LARGE = 256, 512, 1024
CHUNKED_PREFILL, CHUNKED_PREFILL_LARGE = 4096, 12288
LARGE_MODEL_PARAMS = 3_000_000_000  # decoder parameters (no embeddings)


def decoder_params(model_cfg) -> int:
    """The parameters of the decoder layers (no embeddings), every expert of a mixture of
    experts counted (models/param_count.py)."""
    from batchrun.models.param_count import count_params  # the caller has read its ModelConfig

    return count_params(model_cfg).decoder_total


def is_large(model_cfg) -> bool:
    """LARGE_MODEL_PARAMS or more in the decoder layers. NOTE: a mixture of experts counts all
    its experts: each expert's matmul gets about T * top_k / num_experts of a step's T rows, so
    it needs the large model's bigger steps at least as much as a dense model of its active
    size does."""
    return decoder_params(model_cfg) >= LARGE_MODEL_PARAMS


def auto_sizes(model_cfg, device_type: str) -> tuple[int, int]:
    """The default (max_running, chunked_prefill_size): on CUDA (512, 4096), or (1024, 12288)
    for a model of LARGE_MODEL_PARAMS or more; on the CPU (256, 4096).

    NOTE: on the H200 (docs/benchmarks.md, `scripts/bench_throughput.py --workloads W1,W2
    --max-running N --chunked-prefill-size C`): a large model's matmuls need more rows than 256
    or 512 decodes to run at the tensor cores' rate (llama-8b W1 9,888 / 10,827 / 10,942 output
    tok/s at 256 / 512 / 1024 running), and 12,288-token chunks read 0.4 % above 8,192. A small
    model's step is short enough that the host's work per row counts: llama-1b W1 reads 55,597
    at 512 against 51,664 at 256. The KV pool bounds admission either way.
    """
    if device_type != "cuda":
        return MAX_RUNNING, CHUNKED_PREFILL
    if is_large(model_cfg):
        return MAX_RUNNING_LARGE, CHUNKED_PREFILL_LARGE
    return MAX_RUNNING_CUDA, CHUNKED_PREFILL


def resolve_sizes(config: EngineConfig, model_cfg) -> EngineConfig:
    """config with max_running and chunked_prefill_size set where left to auto_sizes."""
    if config.max_running is not None and config.chunked_prefill_size != "auto":
        return config
    device_type = config.device
    if device_type == "auto":
        import torch  # not at the top: the CLI imports this module before it needs torch

        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    max_running, chunk = auto_sizes(model_cfg, device_type)
    if config.max_running is not None:
        max_running = config.max_running
    if config.chunked_prefill_size != "auto":
        chunk = config.chunked_prefill_size
    return replace(config, max_running=max_running, chunked_prefill_size=chunk)


def _one_of(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}; got {value!r}")


@dataclass(frozen=True)
class KernelConfig:
    """What the GPU path runs. On the CPU everything resolves to plain PyTorch.

    attention           attention backend: "torch" (reference, any device), "triton"
                        (kernels/decode_attention.py, extend_attention.py), "flashinfer"
    extend_attention    one of EXTEND_ATTENTIONS for attention "triton"'s extend rows (prefill
                        chunks; the decode rows stay on the Triton decode kernel). "fa3"
                        runs on sm_90 GPUs where flashinfer imports and the model's attention
                        is one it runs (head dim 64 / 128 / 256, a bf16 / fp16 KV pool, no
                        attention sinks), FlashInfer has its kernels (flashinfer-jit-cache,
                        or nvcc to build them) and they run one batch at start-up; auto:
                        "fa3" where it runs, else "triton" (engine/kernel_choice.py gives
                        the figures)
    triton_ops          the small Triton kernels: RMSNorm (with the residual add), rotary with
                        the KV store, the SwiGLU gate, the greedy argmax, the decode graphs'
                        inputs; auto: on CUDA where Triton imports
    pdl                 programmatic dependent launch of those kernels (kernels/pdl.py); auto:
                        on sm_90+ GPUs. Off is for drivers that reject the launch attribute
    decode_gemv         the matmuls of decode batches of up to 16 rows on kernels/gemv.py, an
                        FP8 linear's (scaled_mm) on kernels/fp8_gemv.py ("triton"), or on
                        cuBLAS / torch._scaled_mm; auto: triton where PDL is on and the model
                        is not quantized (engine/kernel_choice.py says what was measured)
    decode_norms        one of DECODE_NORMS for one-row decode steps on kernels/gemv.py; auto:
                        models/fused_decode.py's rule ("all" for hidden sizes up to 2048,
                        "fold-all" above on a dense model whose folded weights fit, else "off")
    cuda_graph_max_bs   decode batches up to this size replay CUDA graphs; 0: none
    piecewise_graphs    prefill and mixed steps replay graphs around an eager attention
                        (engine/piecewise_graph.py); auto: on for models under
                        LARGE_MODEL_PARAMS while cuda_graph_max_bs > 0 (so 0 means no graphs
                        at all unless this is set); needs a chunked prefill size
    host_gate           a grammar step's sampling waits on the device for the host's token
                        bitmask (engine/host_gate.py); auto: where the driver has stream memory
                        operations. Off: such a step is sampled once the bitmask is filled
    fp8_matmul          one of FP8_MATMULS for the FP8 linears of a quantized model:
                        "scaled_mm" keeps the FP8 weights and runs the FP8 tensor cores (per
                        tensor / channel torch._scaled_mm, 128 x 128 blocks fp8_block_gemm's
                        matmul; activations quantized by kernels/fp8_quant.py), "dequant"
                        dequantizes them to bf16 at load; auto: "scaled_mm" on sm_89+ GPUs,
                        except for 128 x 128 blocks without cuBLASLt's block matmul
                        (fp8_block_gemm "triton") whose bf16 weights take at most half the GPU
                        (dequantized: faster than the Triton block matmul), "dequant" elsewhere
                        (the CPU always dequantizes)
    fp8_block_gemm      one of FP8_BLOCK_GEMMS for a block-FP8 linear's batches of more than 16
                        rows with fp8_matmul "scaled_mm"; auto: "cublaslt" where it runs (sm_90,
                        torch with CUDA 12.9+), else "triton". On one H100 (`python
                        scripts/bench_fp8_matmul.py`) cuBLASLt's block matmul takes 1,501.7 µs
                        on llama-8b's gate_up at 8,192 rows where the Triton kernel takes
                        3,412.4 and bf16 cuBLAS 2,607.7
    int4_matmul         one of INT4_MATMULS for the INT4 linears of a quantized model; auto:
                        "triton" on CUDA where Triton imports and the bf16 weights would take
                        more than half the GPU, "dequant-gemv" where the bf16 weights and the
                        packed copy fit that half on an sm_80+ GPU with Triton's Gluon,
                        "dequant" elsewhere (set by hand, "triton" runs on CPU tensors under
                        Triton's interpreter; "dequant-gemv" needs the GPU)
    fp8_fast_accum      torch._scaled_mm's fast accumulation for the per-tensor / per-channel
                        FP8 linears of prefill and large batches: the tensor cores' FP8
                        accumulator over the whole K, not promoted to fp32 every few steps (as
                        vLLM's and SGLang's CUTLASS FP8 GEMMs run; within twice the promoted
                        sums' bf16 error bound, tests/gpu/test_fp8_gpu.py). On by default: W1
                        llama-8b FP8 reads 11,851 output tok/s against 11,237 with the promoted
                        sums (one H100, same run, docs/benchmarks.md). Off: the promoted sums,
                        as the decode GEMV (kernels/fp8_gemv.py) always sums
    moe                 one of MOE_BACKENDS for a mixture of experts' experts: "triton" the fused
                        MoE kernels (kernels/fused_moe.py), "torch" a per-expert loop; auto:
                        "triton" on CUDA where Triton imports, "torch" elsewhere
    moe_decode          one of MOE_DECODES for moe "triton"'s decode batches: "gemv" the
                        GEMVs of kernels/moe_gemv.py where its `takes_gemv` holds, "grouped"
                        the grouped GEMMs always; auto: "gemv" with moe "triton"
                        (engine/kernel_choice.py says what was measured)
    moe_prefill         one of MOE_PREFILLS for moe "triton"'s batches of more than 32 routed
                        rows an expert: "grouped_mm" the experts' matmuls on torch._grouped_mm
                        (kernels/moe_grouped_mm.py), "triton" kernels/fused_moe.py's grouped
                        GEMMs; auto: "grouped_mm" for bf16 experts on sm_90 (CUTLASS's grouped
                        GEMM), "triton" elsewhere (engine/kernel_choice.py says what was
                        measured)
    """

    attention: str = "auto"
    extend_attention: str = "auto"
    triton_ops: bool | None = None
    pdl: bool | None = None
    decode_gemv: str = "auto"
    decode_norms: str = "auto"
    cuda_graph_max_bs: int = 512
    piecewise_graphs: bool | None = None
    host_gate: bool | None = None
    fp8_matmul: str = "auto"
    fp8_block_gemm: str = "auto"
    int4_matmul: str = "auto"
    fp8_fast_accum: bool = True
    moe: str = "auto"
    moe_decode: str = "auto"
    moe_prefill: str = "auto"

    @classmethod
    def reference(cls) -> KernelConfig:
        """Plain PyTorch everywhere: what the CPU resolves to, and the reference on CUDA."""
        return cls(
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
            fp8_block_gemm="triton",
            int4_matmul="dequant",
            moe="torch",
            moe_decode="grouped",
            moe_prefill="triton",
        )

    def validate(self) -> None:
        _one_of("attention backend", self.attention, ATTENTION_BACKENDS)
        _one_of("extend_attention", self.extend_attention, EXTEND_ATTENTIONS)
        _one_of("decode_gemv", self.decode_gemv, DECODE_GEMVS)
        _one_of("decode_norms", self.decode_norms, DECODE_NORMS)
        _one_of("fp8_matmul", self.fp8_matmul, FP8_MATMULS)
        _one_of("fp8_block_gemm", self.fp8_block_gemm, FP8_BLOCK_GEMMS)
        _one_of("int4_matmul", self.int4_matmul, INT4_MATMULS)
        _one_of("moe backend", self.moe, MOE_BACKENDS)
        _one_of("moe_decode", self.moe_decode, MOE_DECODES)
        _one_of("moe_prefill", self.moe_prefill, MOE_PREFILLS)
        if self.cuda_graph_max_bs < 0:
            raise ValueError(f"cuda_graph_max_bs must be >= 0; got {self.cuda_graph_max_bs}")

    @property
    def is_resolved(self) -> bool:
        auto = {
            "attention", "extend_attention", "decode_gemv", "decode_norms", "fp8_matmul",
            "fp8_block_gemm", "int4_matmul", "moe", "moe_decode", "moe_prefill",
        }  # fmt: skip
        return all(
            getattr(self, f.name) != "auto" if f.name in auto else getattr(self, f.name) is not None
            for f in fields(self)
        )

    def describe(self) -> str:
        """One line for the start-up log."""
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF directory, .gguf file, or None for the embedded SmolLM2-135M
    load_format: str = "auto"
    # "fp8": the checkpoint's decoder linears quantized to FP8 at load (per output channel,
    # activations per token; batchrun/quant/online.py); None: run the checkpoint as it is
    quantization: str | None = None
    # load_format "dummy": "normal" draws normal(0, 0.02) with the norms at 1; "uniform" every
    # parameter from U(-1e-3, 1e-3), as vLLM's and SGLang's dummy loaders draw them
    dummy_init: str = "normal"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA (float16 if unsupported)
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    device: str = "auto"  # auto: cuda when available
    max_running: int | None = None  # requests decoded together at most; None: auto_sizes
    kv_budget: int | None = None  # KV pool size in tokens; None: sized from free memory
    # on CUDA without kv_budget: the KV pool takes this fraction of the GPU memory free after the
    # weights (vLLM's option of this name is a fraction of the GPU's total memory for weights,
    # activations and KV together); the CPU does not use it (an eighth of the available memory)
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    # prefill token budget per step; None: unlimited; "auto": auto_sizes
    chunked_prefill_size: int | str | None = "auto"
    page_size: int = 1
    enable_radix_cache: bool = True
    kernels: KernelConfig = field(default_factory=KernelConfig)
    seed: int = 0  # base of per-request seeds when a request has none
    max_pending: int = 4096  # requests pulled from the input iterator ahead of admission
    new_token_ratio: float = 0.4  # expected decode growth as a fraction of max_new_tokens
    context_len: int | None = None  # override the model's max_position_embeddings
    overlap: bool | None = None  # overlap scheduling with the device; None: on for CUDA
    # tensor parallel: this engine is rank tp_rank of tp_size lockstep engines, one per GPU
    # (batchrun.engine_process.tp_launcher.start_tp_engine starts them and sets tp_rank)
    tp_size: int = 1
    tp_rank: int = 0

    def validate(self) -> None:
        _one_of("load_format", self.load_format, LOAD_FORMATS)
        if self.quantization is not None:
            _one_of("quantization", self.quantization, QUANTIZATIONS)
        _one_of("dummy_init", self.dummy_init, DUMMY_INITS)
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _one_of("device", self.device, DEVICES)
        self.kernels.validate()
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"max_running must be >= 1; got {self.max_running}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1; got {self.page_size}")
        if self.kv_budget is not None and self.kv_budget < 16:
            raise ValueError(f"kv_budget must be >= 16 tokens; got {self.kv_budget}")
        chunk = self.chunked_prefill_size
        if chunk is not None and chunk != "auto" and (not isinstance(chunk, int) or chunk < 1):
            raise ValueError("chunked_prefill_size must be >= 1, None (unlimited) or 'auto'")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1; got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size={self.tp_size}); got {self.tp_rank}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}"
            )
