"""Engine configuration (frozen: build a new one with dataclasses.replace to change it)."""

from __future__ import annotations

from dataclasses import dataclass, replace

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
DECODE_GEMVS = ("auto", "cublas", "triton")

# the defaults of max_running (None) and chunked_prefill_size ("auto"): auto_sizes
MAX_RUNNING, MAX_RUNNING_CUDA, MAX_RUNNING_LARGE = 256, 512, 1024
CHUNKED_PREFILL, CHUNKED_PREFILL_LARGE = 4096, 12288
LARGE_MODEL_PARAMS = 3_000_000_000  # decoder parameters (no embeddings)


def is_large(model_cfg) -> bool:
    """LARGE_MODEL_PARAMS or more in the decoder layers."""
    c = model_cfg
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (2 * q + 2 * kv + 3 * c.intermediate_size)
    return c.num_layers * per_layer >= LARGE_MODEL_PARAMS


def auto_sizes(model_cfg, device_type: str) -> tuple[int, int]:
    """The default (max_running, chunked_prefill_size): on CUDA (512, 4096), or (1024, 12288)
    for a model of LARGE_MODEL_PARAMS or more; on the CPU (256, 4096).

    NOTE: measured on the H200 (docs/benchmarks.md), dummy weights, bf16. Sixth session:
    llama-8b W1 read 9,888 / 10,827 / 10,942 output tok/s at max_running 256 / 512 / 1024 (W2
    11,456 / 12,009 / 12,255): its matmuls need more rows than 256 decodes to run at the tensor
    cores' rate; 8,192-token prefill chunks added 0.6 % at 512 and at 1024 (10,987 -> 11,057).
    Seventeenth session, two machines, each chunk in its own process: W1 11,293 / 11,273 /
    11,249 at 12,288 / 16,384 / 8,192 (call 5), 11,071 against 11,027 at 12,288 / 8,192 run in
    the other order (call 6); W2 11,712 against 11,650 (call 6).
    llama-1b then lost W1 at 512 (44,874 -> 40,624, occupancy 0.85 -> 0.72): its steps were
    host-bound. Fifteenth session, with the host's step work since cut: llama-1b W1 read 55,597
    at 512 against 51,664 / 51,596 at 256 (occupancy 0.98 / 0.97): a decode step of 512 rows
    costs 10.0 µs a token against 11.3 at 256, and the host keeps up with it. The KV pool still
    bounds admission either way.
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
        import torch

        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    max_running, chunk = auto_sizes(model_cfg, device_type)
    if config.max_running is not None:
        max_running = config.max_running
    if config.chunked_prefill_size != "auto":
        chunk = config.chunked_prefill_size
    return replace(config, max_running=max_running, chunked_prefill_size=chunk)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF directory, .gguf file, or None for the embedded SmolLM2-135M
    load_format: str = "auto"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA (float16 if unsupported)
    device: str = "auto"  # auto: cuda when available
    max_running: int | None = None  # requests decoded together at most; None: auto_sizes
    kv_budget: int | None = None  # KV pool size in tokens; None: sized from free memory
    kv_memory_fraction: float = 0.85  # on CUDA, fraction of free memory after weights for KV
    # prefill token budget per step; None: unlimited; "auto": auto_sizes
    chunked_prefill_size: int | str | None = "auto"
    page_size: int = 1
    enable_radix_cache: bool = True
    attention_backend: str = "auto"
    seed: int = 0  # base of per-request seeds when a request has none
    max_pending: int = 4096  # requests pulled from the input iterator ahead of admission
    new_token_ratio: float = 0.4  # expected decode growth as a fraction of max_new_tokens
    context_len: int | None = None  # override the model's max_position_embeddings
    overlap: bool | None = None  # overlap scheduling with the device; None: on for CUDA
    cuda_graph_max_bs: int = 512  # decode batches up to this size replay CUDA graphs; 0: off
    # other steps (prefill, mixed, decodes past cuda_graph_max_bs) replay graphs around an eager
    # attention (engine/piecewise_graph.py), up to chunked_prefill_size + max_running tokens
    # (8,192 at most); None: on for CUDA models under LARGE_MODEL_PARAMS while
    # cuda_graph_max_bs > 0
    piecewise_cuda_graph: bool | None = None
    # the matmuls of decode-sized batches (at most 16 rows): "triton" runs every one on
    # kernels/gemv.py, launched with PDL (kernels/pdl.py); "cublas" on torch's F.linear; "auto":
    # triton on CUDA GPUs with PDL (sm_90+, BATCHRUN_PDL not "0"), else cublas.
    # NOTE: measured on the H200 (docs/benchmarks.md, ninth session: gemv's split-K reduced in
    # the kernel, the SwiGLU as gate_up's epilogue), same calls: W3 llama-1b 1.04 ms per token
    # against 1.13 with cuBLAS; llama-8b 4.49 against 4.60 (the eighth session's gemv, without
    # those, had gained nothing on llama-8b, which then kept cuBLAS)
    decode_gemv: str = "auto"
    # tensor parallel: this engine is rank tp_rank of tp_size lockstep engines, one per GPU
    # (batchrun.parallel.launcher.start_tp_engine starts them and sets tp_rank)
    tp_size: int = 1
    tp_rank: int = 0

    def validate(self) -> None:
        def one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")

        one_of("load_format", self.load_format, LOAD_FORMATS)
        one_of("dtype", self.dtype, DTYPES)
        one_of("device", self.device, DEVICES)
        one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        one_of("decode_gemv", self.decode_gemv, DECODE_GEMVS)
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
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1]; got {self.kv_memory_fraction}")
