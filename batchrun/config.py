"""Engine configuration: EngineConfig (the user's choices) and KernelPlan (the kernel plan).

Both are frozen (build a new one with dataclasses.replace). EngineConfig holds what a user
chooses, each with a CLI option: among them the few kernel choices (the reference path or the
fast path, CUDA graphs and their largest batch, the compatibility switches PDL and host gate,
quantized weights dequantized or kept). Fields left at "auto" / None are resolved once, when the
engine starts: the step sizes by `resolve_sizes`; the kernel plan, a KernelPlan with every
field concrete, by `engine/kernel_choice.py`'s rules from the device, the torch build and the
model. The plan is logged at start-up and written into a run's manifest.json. A benchmark
overrides plan fields explicitly (Engine(config, kernels=KernelPlan(field=...))), never
through EngineConfig.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
DUMMY_INITS = ("normal", "uniform")
# the kernel plan's fields (KernelPlan), "auto": engine/kernel_choice.py's rule decides
ATTENTION_BACKENDS = ("auto", "torch", "triton")
EXTEND_ATTENTIONS = ("auto", "triton", "fa3")
DECODE_GEMVS = ("auto", "cublas", "triton")
DECODE_NORMS = ("auto", "off", "all", "fold-all")
FP8_MATMULS = ("auto", "scaled_mm", "dequant")
INT4_MATMULS = ("auto", "triton", "dequant", "dequant-gemv")
MOE_BACKENDS = ("auto", "triton", "torch")
MOE_DECODES = ("auto", "grouped", "gemv")
MOE_PREFILLS = ("auto", "triton", "grouped_mm")
PER_LAYER_TABLES = ("auto", "device", "host")
LINEAR_ATTENTIONS = ("auto", "torch", "fla")
CUDA_GRAPH_MAX_BS = 512  # EngineConfig.cuda_graph_max_bs: decode batches replayed as graphs
QUANTIZATIONS = ("fp8",)  # EngineConfig.quantization: a bf16 checkpoint quantized at load
# EngineConfig.kv_cache_dtype: "auto" the compute dtype; "fp8_e4m3" float8_e4m3fn with the
# checkpoint's per-layer k/v scales (else 1.0), one byte an element (batchrun/quant/kv_cache.py)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
# EngineConfig.linear_state_dtype: the element type of a hybrid model's recurrent states (the
# conv and delta-rule state of its linear-attention layers, engine/state_pool.py; docs/hybrid.md,
# "The state's dtype", holds the measurement that chose the default)
LINEAR_STATE_DTYPES = ("float32", "bfloat16")

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

    NOTE: a large model's matmuls need more rows than 256 or 512 decodes to run at the tensor
    cores' rate, and its larger prefill chunks read a little faster; a small model's step is
    short enough that the host's work per row counts, so it runs 512, not 256
    (docs/benchmarks.md, Throughput and latency). The KV pool bounds admission either way.
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
class KernelPlan:
    """The kernel plan: what the GPU path runs, every field concrete once resolved
    (engine/kernel_choice.py holds the rule of each; on the CPU everything is plain PyTorch,
    `reference()`). A field left "auto" / None is the rule's to decide: so KernelPlan(...) with
    a few fields set is also how a benchmark or a test overrides the plan (Engine(config,
    kernels=...)); an override that cannot run here is refused with a message.

    attention           "torch" (reference, any device), "triton" (kernels/decode_attention.py,
                        extend_attention.py)
    extend_attention    attention "triton"'s extend rows (prefill chunks; the decode rows stay
                        on the decode kernel): "triton" kernels/extend_attention.py, "fa3"
                        FlashInfer's FlashAttention-3 paged prefill (attention/fa3_prefill.py)
    triton_ops          the small Triton kernels: RMSNorm (with the residual add), rotary with
                        the KV store, the SwiGLU gate, the greedy argmax, the decode graphs'
                        inputs
    pdl                 programmatic dependent launch of the Triton kernels (kernels/pdl.py)
    decode_gemv         the matmuls of decode batches of up to 16 rows: "triton"
                        kernels/gemv.py (an FP8 linear's: kernels/fp8_gemv.py), "cublas"
                        F.linear / torch._scaled_mm
    decode_norms        how a one-row decode step on kernels/gemv.py runs the residual adds and
                        RMSNorms between its matmuls (models/fused_decode.py): "off" kernels of
                        their own; "all" each inside the matmul before it (o_proj, down_proj);
                        "fold-all" inside the matmul after them (qkv's, gate_up's)
    cuda_graph_max_bs   decode batches up to this size replay CUDA graphs; 0: none
    piecewise_graphs    prefill and mixed steps replay graphs around an eager attention
                        (engine/piecewise_graph.py)
    host_gate           a grammar step's sampling waits on the device for the host's token
                        bitmask (engine/host_gate.py); off: sampled once the bitmask is filled
    fp8_matmul          a quantized model's FP8 linears: "scaled_mm" the FP8 weights kept, on
                        the FP8 tensor cores (per tensor / channel torch._scaled_mm, 128 x 128
                        blocks cuBLASLt's block-scaled F.scaled_mm; activations quantized by
                        kernels/fp8_quant.py), "dequant" dequantized to the compute dtype at load
    int4_matmul         a quantized model's INT4 linears (AWQ, GPTQ, compressed-tensors W4A16):
                        "triton" the packed weights on kernels/int4_matmul.py (decode batches
                        of up to 16 rows on kernels/int4_gemv_mma.py where it takes the
                        weight), "dequant" dequantized at load, "dequant-gemv" dequantized and
                        also kept packed for kernels/int4_gemv_mma.py's decode batches
    fp8_fast_accum      torch._scaled_mm's fast accumulation for the per-tensor / per-channel
                        FP8 linears of prefill and large batches (the tensor cores' FP8
                        accumulator over the whole K, as vLLM's and SGLang's CUTLASS FP8 GEMMs
                        run); off: the sums promoted to fp32, as kernels/fp8_gemv.py sums
    moe                 a mixture of experts' experts: "triton" kernels/fused_moe.py, "torch" a
                        per-expert loop that reads the routing on the host (the reference)
    moe_decode          moe "triton"'s decode batches: "gemv" the router in one kernel
                        (kernels/moe_route.py) and the experts on kernels/moe_gemv.py where its
                        `takes_gemv` holds, "grouped" kernels/fused_moe.py's grouped GEMMs
    moe_prefill         moe "triton"'s batches past 32 routed rows an expert: "grouped_mm"
                        torch._grouped_mm (CUTLASS's grouped GEMM) with
                        kernels/moe_grouped_mm.py's gather, SwiGLU and sum, "triton"
                        kernels/fused_moe.py's grouped GEMMs
    compile_workers     processes that compile the decode graphs' Triton variants in parallel
                        before the capture (engine/precompile.py); 0: the capture compiles them
                        one after another
    per_layer_table     a table of ModelConfig.host_table_elements (Gemma 4's per-layer
                        embeddings): "device" with the other weights, "host" in pinned host
                        memory, its rows read by the GPU (kernels/host_gather.py)
    linear_attention    a hybrid model's Gated DeltaNet layers: "fla" fla-core's chunked
                        (prefill) and recurrent (decode) kernels with kernels/causal_conv1d.py
                        (models/blocks/delta_rule_fla.py), "torch" models/blocks/delta_rule.py
    """

    attention: str = "auto"
    extend_attention: str = "auto"
    triton_ops: bool | None = None
    pdl: bool | None = None
    decode_gemv: str = "auto"
    decode_norms: str = "auto"
    cuda_graph_max_bs: int | None = None
    piecewise_graphs: bool | None = None
    host_gate: bool | None = None
    fp8_matmul: str = "auto"
    int4_matmul: str = "auto"
    fp8_fast_accum: bool | None = None
    moe: str = "auto"
    moe_decode: str = "auto"
    moe_prefill: str = "auto"
    compile_workers: int | None = None
    per_layer_table: str = "auto"
    linear_attention: str = "auto"

    @classmethod
    def reference(cls) -> KernelPlan:
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
            int4_matmul="dequant",
            fp8_fast_accum=True,
            moe="torch",
            moe_decode="grouped",
            moe_prefill="triton",
            compile_workers=0,
            per_layer_table="device",
            linear_attention="torch",
        )

    def validate(self) -> None:
        _one_of("attention backend", self.attention, ATTENTION_BACKENDS)
        _one_of("extend_attention", self.extend_attention, EXTEND_ATTENTIONS)
        _one_of("decode_gemv", self.decode_gemv, DECODE_GEMVS)
        _one_of("decode_norms", self.decode_norms, DECODE_NORMS)
        _one_of("fp8_matmul", self.fp8_matmul, FP8_MATMULS)
        _one_of("int4_matmul", self.int4_matmul, INT4_MATMULS)
        _one_of("moe backend", self.moe, MOE_BACKENDS)
        _one_of("moe_decode", self.moe_decode, MOE_DECODES)
        _one_of("moe_prefill", self.moe_prefill, MOE_PREFILLS)
        _one_of("per_layer_table", self.per_layer_table, PER_LAYER_TABLES)
        _one_of("linear_attention", self.linear_attention, LINEAR_ATTENTIONS)
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 0:
            raise ValueError(f"cuda_graph_max_bs must be >= 0; got {self.cuda_graph_max_bs}")

    @property
    def is_resolved(self) -> bool:
        return all(getattr(self, f.name) not in ("auto", None) for f in fields(self))

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
    linear_state_dtype: str = "float32"  # one of LINEAR_STATE_DTYPES (hybrid models)
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
    # the kernel choices (engine/kernel_choice.py turns them and the machine into the plan):
    # plain PyTorch everywhere (the reference path) rather than the fast path
    reference_kernels: bool = False
    cuda_graph_max_bs: int = CUDA_GRAPH_MAX_BS  # 0: every step eagerly (no graphs at all)
    piecewise_graphs: bool = True  # False: prefill and mixed steps eagerly
    pdl: bool = True  # False: no programmatic dependent launch (drivers that reject it)
    host_gate: bool = True  # False: no stream wait on the host (drivers without one)
    # a quantized checkpoint's weights dequantized to the compute dtype at load; False: kept
    # quantized where a kernel runs them (the plan's rule: kernel_choice.py)
    dequantize: bool = False
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
        _one_of("linear_state_dtype", self.linear_state_dtype, LINEAR_STATE_DTYPES)
        _one_of("device", self.device, DEVICES)
        if self.cuda_graph_max_bs < 0:
            raise ValueError(f"cuda_graph_max_bs must be >= 0; got {self.cuda_graph_max_bs}")
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
