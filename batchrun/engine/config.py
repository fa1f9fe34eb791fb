"""Engine configuration (frozen: build a new one with dataclasses.replace to change it)."""

from __future__ import annotations

from dataclasses import dataclass, replace

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")

# max_running when none is given (auto_max_running)
MAX_RUNNING = 256
MAX_RUNNING_LARGE = 1024
LARGE_MODEL_PARAMS = 3_000_000_000  # decoder parameters (no embeddings)


def auto_max_running(model_cfg, device_type: str) -> int:
    """The default cap on requests decoded together: MAX_RUNNING, or MAX_RUNNING_LARGE for a
    model of LARGE_MODEL_PARAMS or more on CUDA.

    NOTE: measured on the H200 (docs/benchmarks.md, sixth session), dummy weights, bf16: llama-8b
    W1 read 9,888 / 10,827 / 10,942 output tok/s at 256 / 512 / 1024 (W2 11,456 / 12,009 /
    12,255): its decode matmuls need more rows than 256 to run at the tensor cores' rate. On
    llama-1b the step is host-bound and W1 lost at 512 and 1024 (44,874 / 40,624 / 41,761): a
    bigger batch only adds host work per step. The KV pool still bounds admission either way.
    """
    c = model_cfg
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = (
        2 * c.hidden_size * q + 2 * c.hidden_size * kv + 3 * c.hidden_size * c.intermediate_size
    )
    large = c.num_layers * per_layer >= LARGE_MODEL_PARAMS
    return MAX_RUNNING_LARGE if device_type == "cuda" and large else MAX_RUNNING


def resolve_max_running(config: EngineConfig, model_cfg) -> EngineConfig:
    """config with max_running set (auto_max_running where it is None)."""
    if config.max_running is not None:
        return config
    device_type = config.device
    if device_type == "auto":
        import torch

        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return replace(config, max_running=auto_max_running(model_cfg, device_type))


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF directory, .gguf file, or None for the embedded SmolLM2-135M
    load_format: str = "auto"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA (float16 if unsupported)
    device: str = "auto"  # auto: cuda when available
    max_running: int | None = None  # requests decoded together at most; None: auto_max_running
    kv_budget: int | None = None  # KV pool size in tokens; None: sized from free memory
    kv_memory_fraction: float = 0.85  # on CUDA, fraction of free memory after weights for KV
    chunked_prefill_size: int | None = 4096  # prefill token budget per step; None: unlimited
    page_size: int = 1
    enable_radix_cache: bool = True
    attention_backend: str = "auto"
    seed: int = 0  # base of per-request seeds when a request has none
    max_pending: int = 4096  # requests pulled from the input iterator ahead of admission
    new_token_ratio: float = 0.4  # expected decode growth as a fraction of max_new_tokens
    context_len: int | None = None  # override the model's max_position_embeddings
    overlap: bool | None = None  # overlap scheduling with the device; None: on for CUDA
    cuda_graph_max_bs: int = 512  # decode batches up to this size replay CUDA graphs; 0: off
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
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"max_running must be >= 1; got {self.max_running}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1; got {self.page_size}")
        if self.kv_budget is not None and self.kv_budget < 16:
            raise ValueError(f"kv_budget must be >= 16 tokens; got {self.kv_budget}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise ValueError("chunked_prefill_size must be >= 1 or None (unlimited)")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1; got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size={self.tp_size}); got {self.tp_rank}")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1]; got {self.kv_memory_fraction}")
