"""What the benchmark scripts share: the benchmark models' shapes, the source tree's commit id,
a run's header, the device's sync and memory calls, the engine options every engine benchmark
takes (they build one EngineConfig and the plan's overrides), BENCH.md's workloads, and a timed
`engine.generate` with its first-token probe.

    import benchlib
    model_dir = benchlib.write_model_dir("llama-1b", tmp)        # config.json for dummy weights
    config = benchlib.engine_config(args, model_dir, overlap=False)   # args: add_engine_args
    engine = Engine(config, benchlib.kernel_plan(args))          # the plan's fields set by hand

The models are Llama-3 shapes for `--load-format dummy`: only config.json is written; batchrun's
dummy loader and HF's `from_config` build random weights of those shapes. `tiny` is a CPU-only
shape that exercises a benchmark's logic.

NOTE: torch is imported inside the functions that use it: bench_order.py reports its process's
peak RSS, and importing torch alone adds ~210 MB to it (`python -c "import resource, torch;
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"`: 219 MB against 11 MB without).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from batchrun.config import ATTENTION_BACKENDS, CUDA_GRAPH_MAX_BS, EngineConfig, KernelPlan

# NOTE: the scripts import batchrun as installed (`pip install -e .`): its kernels are the
# top-level kernels/ folder installed as batchrun.kernels, which no path of the checkout gives
ROOT = Path(__file__).resolve().parent.parent

# where a benchmark writes its figures: the device machine's $OUT folder comes back from a run
OUT_DIR = Path(os.environ.get("OUT") or "bench-out")

# -- models ------------------------------------------------------------------------------------

LLAMA3_COMMON = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=128256,
    num_attention_heads=32,
    num_key_value_heads=8,
    hidden_act="silu",
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    bos_token_id=128000,
    eos_token_id=128001,
    attention_bias=False,
    mlp_bias=False,
    initializer_range=0.02,
    torch_dtype="bfloat16",
    use_cache=True,
)

# the fields Qwen3.5's dense and MoE default configs share (transformers' Qwen3_5TextConfig)
QWEN3_5_COMMON = dict(
    vocab_size=248320,
    num_attention_heads=16,
    head_dim=256,
    hidden_act="silu",
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    full_attention_interval=4,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    attention_bias=False,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)

MODELS: dict[str, dict] = {
    # 16.1 GB of bf16 weights
    "llama-8b": dict(
        LLAMA3_COMMON,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        head_dim=128,
        tie_word_embeddings=False,
    ),
    # 2.5 GB of bf16 weights
    "llama-1b": dict(
        LLAMA3_COMMON,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    # NOTE: CPU smoke tests only. The vocab stays above the workloads' token ids (< 30000).
    "tiny": dict(
        LLAMA3_COMMON,
        vocab_size=32000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    ),
    # mixtures of experts (dummy weights; their config.json as the HF repositories ship it):
    # 61.1 GB of bf16 weights, 3.35 B of the 30.53 B parameters active a token
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        hidden_act="silu",
        attention_bias=False,
        bos_token_id=151643,
        eos_token_id=151645,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
    # hybrid linear attention (docs/hybrid.md), transformers' default configs' text models:
    # Qwen3_5Config's (dense) and Qwen3_5MoeConfig's (35B-A3B)
    "qwen3.5-9b": dict(
        QWEN3_5_COMMON,
        architectures=["Qwen3_5ForCausalLM"],
        model_type="qwen3_5_text",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=32,
        num_key_value_heads=4,
    ),  # fmt: skip
    "qwen3.5-35b-a3b": dict(
        QWEN3_5_COMMON,
        architectures=["Qwen3_5MoeForCausalLM"],
        model_type="qwen3_5_moe_text",
        hidden_size=2048,
        num_hidden_layers=40,
        num_key_value_heads=2,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_experts=256,
        num_experts_per_tok=8,
    ),  # fmt: skip
    # 93.4 GB of bf16 weights, 12.88 B of the 46.70 B parameters active a token
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_local_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        hidden_act="silu",
        sliding_window=None,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
    # Gemma 3 4B (the text model of Gemma3ForConditionalGeneration; the vision tower's weights
    # are not built): 3.88 B parameters, sliding layers of 1,024 tokens five in six
    "gemma-3-4b": dict(
        architectures=["Gemma3ForConditionalGeneration"],
        model_type="gemma3",
        eos_token_id=[1, 106],
        text_config=dict(
            model_type="gemma3_text",
            hidden_size=2560,
            intermediate_size=10240,
            num_hidden_layers=34,
            rope_scaling=dict(factor=8.0, rope_type="linear"),
            sliding_window=1024,
        ),
        vision_config=dict(model_type="siglip_vision_model"),
        torch_dtype="bfloat16",
    ),
    # gpt-oss-20b: 20.9 B parameters, 4.2 B active a token (3.0 B in its layers); the experts in
    # bf16, as a released checkpoint's MXFP4 experts are dequantized at load
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        attention_bias=True,
        eos_token_id=200002,
        experts_per_token=4,
        head_dim=64,
        hidden_act="silu",
        hidden_size=2880,
        initial_context_length=4096,
        intermediate_size=2880,
        layer_types=["sliding_attention", "full_attention"] * 12,
        max_position_embeddings=131072,
        num_attention_heads=64,
        num_experts_per_tok=4,
        num_hidden_layers=24,
        num_key_value_heads=8,
        num_local_experts=32,
        pad_token_id=199999,
        rms_norm_eps=1e-05,
        rope_scaling=dict(
            beta_fast=32.0,
            beta_slow=1.0,
            factor=32.0,
            original_max_position_embeddings=4096,
            rope_type="yarn",
            truncate=False,
        ),
        rope_theta=150000,
        sliding_window=128,
        swiglu_limit=7.0,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        vocab_size=201088,
    ),
}

# Gemma 4 at transformers' Gemma4TextConfig defaults (30 layers, every 6th full at head dim 512,
# the sliding ones at 256 over a 512-token window): the dense shape without per-layer inputs;
# the E-shape with them (hidden_size_per_layer_input 256) and the last 10 layers KV-shared with
# a double-wide MLP; the MoE shape with 128 experts of width 704, top 8, beside the dense MLP
# (transformers' defaults leave the experts unset). Each has a `-twin`: every layer full at its
# own head dim, no KV shared, no per-layer inputs' sharing (the KV-pool capacity baseline).
GEMMA4_DENSE = dict(
    architectures=["Gemma4ForCausalLM"],
    model_type="gemma4_text",
    vocab_size=262144,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=30,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    global_head_dim=512,
    sliding_window=512,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131072,
    rms_norm_eps=1e-6,
    hidden_size_per_layer_input=0,
    tie_word_embeddings=True,
    bos_token_id=2,
    eos_token_id=1,
    torch_dtype="bfloat16",
)
GEMMA4_E = dict(
    GEMMA4_DENSE,
    hidden_size_per_layer_input=256,
    vocab_size_per_layer_input=262144,
    num_kv_shared_layers=10,
    use_double_wide_mlp=True,
)
GEMMA4_MOE = dict(
    GEMMA4_DENSE, enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704
)


def gemma4_twin(config: dict) -> dict:
    """`config` with every layer full at its own head dim (the full ones' global_head_dim, the
    others' head_dim) and no KV shared."""
    layers = config["num_hidden_layers"]
    full = [i for i in range(layers) if (i + 1) % 6 == 0 or i == layers - 1]
    return dict(
        config,
        layer_types=["full_attention"] * layers,
        per_layer_config={f"{i:02d}": {"head_dim": config["global_head_dim"]} for i in full},
        num_kv_shared_layers=0,
        use_double_wide_mlp=False,
    )


MODELS.update(
    {
        "gemma-4-dense": GEMMA4_DENSE,
        "gemma-4-dense-twin": gemma4_twin(GEMMA4_DENSE),
        "gemma-4-e": GEMMA4_E,
        "gemma-4-e-twin": gemma4_twin(GEMMA4_E),
        "gemma-4-moe": GEMMA4_MOE,
        "gemma-4-moe-twin": gemma4_twin(GEMMA4_MOE),
    }
)


# Llama 3.1's 128k context (its rope scaling): the long-document workloads' models (W5, W6)
LONG_CONTEXT = dict(
    max_position_embeddings=131072,
    rope_scaling=dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
)


# the quantization_config of a checkpoint format's dummy weights: FP8 in 128 x 128 blocks with
# activations per token in groups of 128 (`quant_method: fp8`), INT4 in AWQ's GEMM layout
CHECKPOINT_FORMATS = {
    "fp8-block": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
    "awq": {
        "quant_method": "awq",
        "version": "gemm",
        "bits": 4,
        "group_size": 128,
        "zero_point": True,
    },
}


def write_model_dir(
    name: str, root: Path, long_context: bool = False, checkpoint_format: str | None = None
) -> Path:
    """Write `name`'s config.json under root/name and return that directory; `long_context`:
    with LONG_CONTEXT's 128k context (a dense Llama shape); `checkpoint_format`: with that
    CHECKPOINT_FORMATS quantization_config (dummy weights in that format)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    config = {**MODELS[name], **(LONG_CONTEXT if long_context else {})}
    if checkpoint_format is not None:
        config["quantization_config"] = CHECKPOINT_FORMATS[checkpoint_format]
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def is_llama_shape(name: str) -> bool:
    """A dense Llama shape (linear_shapes and prefill_flops read its fields): not a mixture of
    experts, not a Gemma 3 (whose fields sit in text_config), not a Gemma 4 (layers of two head
    dims)."""
    c = MODELS[name]
    return not {"num_experts_per_tok", "text_config", "global_head_dim"} & set(c)


def linear_shapes(name: str) -> list[tuple[str, int, int, int]]:
    """(matrix, N, K, count per decode step) of a dense model's linear layers."""
    c = MODELS[name]
    if not is_llama_shape(name):
        raise ValueError(f"{name} is not a dense Llama shape (a mixture of experts or Gemma 3)")
    hidden, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    return [
        ("qkv", q + 2 * kv, hidden, layers),
        ("o", hidden, q, layers),
        ("gate_up", 2 * inter, hidden, layers),
        ("down", hidden, inter, layers),
        ("lm_head", c["vocab_size"], hidden, 1),
    ]


def num_params(name: str) -> int:
    """Parameter count of a model shape (for the log: bf16 bytes = 2x this); a mixture of
    experts' total, every expert counted."""
    from batchrun.models.config import ModelConfig
    from batchrun.models.param_count import count_params

    return count_params(ModelConfig.from_dict(MODELS[name])).total


# -- which source ran ------------------------------------------------------------------------


def _git(*args: str, env: dict | None = None, root: Path = ROOT) -> str:
    return subprocess.check_output(
        ["git", *args], cwd=root, text=True, stderr=subprocess.DEVNULL, env=env
    ).strip()


def worktree_tree(root: Path = ROOT) -> str:
    """The tree hash of the working tree as `git add -A && git write-tree` would give it, built
    in a scratch index (the repository's own index is not touched)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GIT_INDEX_FILE=str(Path(tmp) / "index"))
        _git("add", "-A", env=env, root=root)
        return _git("write-tree", env=env, root=root)


def git_commit(root: Path = ROOT) -> str:
    """The source a benchmark ran, for its header and JSON: a clean checkout is its short HEAD;
    a tree with changes is "HEAD+dirty (tree T)", T the tree hash git would give the working
    tree (tracked and untracked files, .gitignore honoured) if it were committed; "HEAD+dirty"
    where the tree cannot be hashed (a read-only .git); BATCHRUN_COMMIT or "unknown" outside a
    checkout.

    NOTE: the GPU machine runs a copy of the working tree whose .git may be older than the code,
    so its HEAD alone says little; T matches the local commit of the same files:
    `git log --format='%h %T' | grep T`."""
    try:
        head = _git("rev-parse", "--short", "HEAD", root=root)
        if not _git("status", "--porcelain", root=root):
            return head
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("BATCHRUN_COMMIT", "unknown")
    try:
        return f"{head}+dirty (tree {worktree_tree(root)[:10]})"
    except (OSError, subprocess.CalledProcessError):
        return f"{head}+dirty"


def environment(device: str) -> dict:
    """A run's header: date, GPU, CPU, versions, commit and command line."""
    import torch

    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "none (CPU)",
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": package_version("transformers"),
        "commit": git_commit(),
        "command": "python " + " ".join(sys.argv),
    }


def package_version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


class Device:
    """The sync and memory calls of a benchmark's device ("cuda" or "cpu")."""

    def __init__(self, name: str):
        import torch

        self.type = name
        self.is_cuda = name == "cuda"
        self._cuda = torch.cuda if self.is_cuda else None

    def sync(self) -> None:
        if self._cuda is not None:
            self._cuda.synchronize()

    def reset_peak(self) -> None:
        if self._cuda is not None:
            self._cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float | None:
        return self._cuda.max_memory_allocated() / 2**30 if self._cuda is not None else None

    def free(self) -> None:
        gc.collect()
        if self._cuda is not None:
            self._cuda.empty_cache()


def set_engine_threads(device: str) -> None:
    """torch's intra-op threads as the product's engine process sets them on a GPU
    (engine_process/worker.py); the CPU keeps torch's default."""
    if device == "cuda":
        import torch

        from batchrun.engine_process.worker import GPU_ENGINE_THREADS

        torch.set_num_threads(GPU_ENGINE_THREADS)


# -- engine options ----------------------------------------------------------------------------


def _chunk_size(value: str) -> int | str:
    return value if value == "auto" else int(value)


def _kernel_field(item: str) -> tuple[str, object]:
    """FIELD=VALUE of a KernelPlan (plan) field: true / false / auto (None) for the switches,
    an integer for cuda_graph_max_bs, a name for the others."""
    name, sep, value = item.partition("=")
    default = {f.name: f.default for f in fields(KernelPlan)}
    if not sep or name not in default:
        raise argparse.ArgumentTypeError(f"FIELD=VALUE with FIELD one of {', '.join(default)}")
    if isinstance(default[name], str):
        return name, value
    if name == "cuda_graph_max_bs":
        return name, None if value == "auto" else int(value)
    switch = {"true": True, "false": False, "auto": None}
    if value.lower() not in switch:
        raise argparse.ArgumentTypeError(f"{name} takes true, false or auto; got {value!r}")
    return name, switch[value.lower()]


def add_engine_args(
    p: argparse.ArgumentParser,
    *,
    max_running: int | None = None,
    kv_budget: int | None = None,
    cuda_graph_max_bs: int = CUDA_GRAPH_MAX_BS,
) -> None:
    """The options that engine_config turns into an EngineConfig and kernel_plan into the
    plan's overrides (a KernelPlan whose fields left auto are the engine's rules')."""
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--max-running", type=int, default=max_running, help="default: the engine's")
    p.add_argument("--kv-budget", type=int, default=kv_budget, help="KV tokens; default: memory")
    p.add_argument(
        "--chunked-prefill-size", type=_chunk_size, default="auto",
        help="prefill tokens a step (default: the engine's)",
    )  # fmt: skip
    p.add_argument("--page-size", type=int, default=1, help="KV slots allocated together")
    p.add_argument(
        "--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
        help="the plan's attention field (auto: the engine's rule)",
    )  # fmt: skip
    p.add_argument("--cuda-graph-max-bs", type=int, default=cuda_graph_max_bs, help="0: no graphs")
    p.add_argument("--quantization", default=None, help="fp8: the bf16 weights quantized at load")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8_e4m3")
    p.add_argument(
        "--linear-state-dtype", default="float32", choices=("float32", "bfloat16"),
        help="a hybrid model's recurrent states (docs/hybrid.md)",
    )  # fmt: skip
    p.add_argument(
        "--kernel", type=_kernel_field, action="append", default=[], metavar="FIELD=VALUE",
        help="a plan (KernelPlan) field over the engine's rule, repeatable: moe_decode=grouped",
    )  # fmt: skip


def dtype_name(args) -> str:
    return args.dtype or ("bfloat16" if args.device == "cuda" else "float32")


def kernel_plan(args, kernels: dict | None = None) -> KernelPlan:
    """The plan fields of add_engine_args' options (--attention-backend, --kernel), and
    `kernels` (a variant's) over them: Engine(config, kernels=kernel_plan(args))."""
    kernel_fields = dict(attention=args.attention_backend)
    kernel_fields.update(args.kernel)
    kernel_fields.update(kernels or {})
    return KernelPlan(**kernel_fields)


def engine_config(args, model_dir: Path, **changes) -> EngineConfig:
    """The EngineConfig of add_engine_args' options for dummy weights in model_dir; `changes`:
    EngineConfig fields over them."""
    config = dict(
        model=str(model_dir),
        load_format="dummy",
        device=args.device,
        dtype=dtype_name(args),
        max_running=args.max_running,
        kv_budget=args.kv_budget,
        chunked_prefill_size=args.chunked_prefill_size,
        page_size=args.page_size,
        quantization=getattr(args, "quantization", None),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        linear_state_dtype=getattr(args, "linear_state_dtype", "float32"),
        cuda_graph_max_bs=args.cuda_graph_max_bs,
    )
    config.update(changes)
    return EngineConfig(**config)


# -- workloads (BENCH.md) ----------------------------------------------------------------------

TOKEN_LOW, TOKEN_HIGH = 1000, 30000  # prompt ids: inside every model's vocabulary (and SmolLM2's)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_len: int
    note: str


def _shared_prefix(seed: int, groups: int, prefix_len: int) -> list[list[int]]:
    """groups x 32 prompts, each its group's prefix and 128 tokens of its own, shuffled."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        prefix = random_tokens(rng, prefix_len)
        prompts.extend(prefix + random_tokens(rng, 128) for _ in range(32))
    rng.shuffle(prompts)
    return prompts


def make_workload(name: str, scale: float) -> Workload:
    """BENCH.md's workloads; `scale` shrinks the number of prompts (W2: groups), never lengths.
    W1 random prompts, W2 shared prefixes, W3 a single request; W2L (W2-large): 64 groups x 32
    questions over 2,048-token prefixes = 131,072 distinct prefix tokens, for a KV pool capped
    below that (--kv-budget 65536), where prefix order against input order is the figure."""
    if name == "W1":
        rng = random.Random(0)
        n = max(1, round(2000 * scale))
        return Workload(name, [random_tokens(rng, 512) for _ in range(n)], 256, f"{n} x 512 in")
    if name == "W2":
        groups = max(1, round(32 * scale))
        prompts = _shared_prefix(1, groups, 1024)
        return Workload(name, prompts, 128, f"{groups} groups x 32, 1024+128 in")
    if name == "W3":
        return Workload(name, [random_tokens(random.Random(3), 512)], 256, "1 x 512 in")
    if name == "W2L":
        groups = max(1, round(64 * scale))
        prompts = _shared_prefix(2, groups, 2048)
        return Workload(name, prompts, 128, f"{groups} groups x 32, 2048+128 in, shuffled")
    if name in LONG_WORKLOADS:
        count, length, out_len = LONG_WORKLOADS[name]
        rng = random.Random(5 if name == "W5" else 6)
        n = max(1, round(count * scale))
        prompts = [random_tokens(rng, length) for _ in range(n)]
        return Workload(name, prompts, out_len, f"{n} x {length:,} in")
    raise ValueError(f"unknown workload {name!r}; known: W1, W2, W3, W2L, W5, W6")


# long documents: name -> (prompts, prompt tokens, output tokens). W6's prompt and its 64 output
# tokens fill Llama 3.1's 128k context (131,072 positions; BENCH.md's 131,072-token prompt leaves
# no room for an output token, and every engine refuses it), run on llama-8b only
LONG_WORKLOADS = {"W5": (256, 16384, 128), "W6": (16, 131072 - 64, 64)}


def prefill_flops(name: str, prompt_lens: list[int]) -> float:
    """Model FLOPs of prefilling these prompts on model `name` (dense): the linear layers
    (2 a weight a token; the LM head for the last position of each prompt only) and causal
    attention (QK^T and PV: 2 x 2 x head_dim a visible key, a query and a head, each layer)."""
    c = MODELS[name]
    shapes = linear_shapes(name)
    per_token = 2 * sum(n * k * count for matrix, n, k, count in shapes if matrix != "lm_head")
    head = 2 * c["vocab_size"] * c["hidden_size"]
    attention = 4 * c["num_hidden_layers"] * c["num_attention_heads"] * c["head_dim"]
    # query j (0-based) sees j + 1 keys: L (L + 1) / 2 visible keys a head
    return float(sum(per_token * n + head + attention * n * (n + 1) / 2 for n in prompt_lens))


def warmup_prompts(workload: Workload, num: int) -> list[list[int]]:
    """Prompts of the workload's lengths with other tokens (no prefix-cache hits on the real
    ones)."""
    rng = random.Random(1234)
    return [random_tokens(rng, len(p)) for p in workload.prompts[:num]]


# -- timed runs --------------------------------------------------------------------------------


@dataclass
class RunResult:
    model: str
    workload: str
    variant: str
    status: str = "ok"  # ok | skipped | error | bad (wrong output lengths)
    note: str = ""
    num_requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    wall_s: float | None = None  # median over repeats
    walls_s: list[float] = field(default_factory=list)
    output_tok_s: float | None = None
    total_tok_s: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    # model FLOPs of the prompts (benchlib.prefill_flops) / the time to the last first token
    prefill_tflops: float | None = None
    ms_per_token: float | None = None  # W3: wall / output_len
    decode_ms_per_token: float | None = None  # W3: (wall - TTFT) / (output_len - 1)
    forward_occupancy: float | None = None
    cached_fraction: float | None = None
    peak_mem_gib: float | None = None
    num_steps: int | None = None
    kv_slots: int | None = None  # the engine's KV pool, in tokens
    window_requests: int | None = None  # requests whose windows the window pool holds
    retractions: int | None = None  # requests sent back to the queue for KV (recomputed)
    startup_s: float | None = None
    warmup_s: float | None = None
    kernels: dict | None = None  # the engine's resolved KernelPlan


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def fill_latency(res: RunResult, ttfts: list[float], itls: list[float], out_len: int) -> None:
    if ttfts:
        res.ttft_p50_ms = 1e3 * statistics.median(ttfts)
        res.ttft_p99_ms = 1e3 * percentile(ttfts, 99)
    if itls:
        res.itl_p50_ms = 1e3 * statistics.median(itls)
    if res.workload == "W3" and res.wall_s:
        res.ms_per_token = 1e3 * res.wall_s / out_len
        if ttfts and out_len > 1:
            res.decode_ms_per_token = 1e3 * (res.wall_s - ttfts[0]) / (out_len - 1)


class LatencyProbe:
    """Host time at which each request's first token reached the host.

    NOTE: GenerateResult carries no timestamps and results arrive only at finish, so this wraps
    the engine's per-step result processing (`_process`, an internal, wrapped for measurement
    only; a scan of the step's output indices). Under overlap, step n is processed after step
    n+1 is launched: that is when the host sees the token, so it is what a caller measures too.
    """

    def __init__(self, engine):
        self.first: dict[tuple[str, int], float] = {}
        original = getattr(engine, "_process", None)
        self.active = callable(original)
        if not self.active:
            return

        def process(launched, *args, **kwargs):
            out = original(launched, *args, **kwargs)
            out_index = getattr(launched, "out_index", None)
            if out_index and 0 in out_index:
                now = time.perf_counter()
                for req, idx in zip(launched.reqs, out_index):
                    if idx == 0:
                        self.first.setdefault((req.rid, req.index), now)
            return out

        engine._process = process


def greedy_params(out_len: int):
    """Exactly out_len greedy tokens a request (EOS ignored)."""
    from batchrun.params import SamplingParams

    return SamplingParams(
        max_new_tokens=out_len, min_new_tokens=out_len, temperature=0.0, ignore_eos=True
    )


def expert_tile_tokens(max_tokens: int) -> list[int]:
    """Token counts that reach each bucket of kernels/fused_moe.py tile_tokens up to max_tokens
    (a mixture of experts' piecewise-graph sizes: powers of two to 256, then multiples of 256),
    each bucket's top and the count below it: the tiles, and Triton's specializations of a
    routed-row count on its divisibility by 16."""
    from batchrun.engine.piecewise_graph import token_buckets

    tops = token_buckets(max_tokens, small=True)
    return sorted({n for top in tops for n in (top - 1, top) if n >= 1})


def warm_expert_tiles(engine, max_tokens: int = 8192 + 512) -> int:
    """Run one mixture-of-experts layer of the engine's model (fused Triton experts only) at
    expert_tile_tokens(max_tokens): a workload's warm-up reaches few of the tile variants its
    steps then compile inside the timed run (2.4 s of W1 on qwen3-30b-a3b, 6.7 s on
    gpt-oss-20b). Returns the calls made (0: no such layer)."""
    import torch

    from batchrun.layers.moe import MoE

    model = getattr(getattr(engine, "runner", None), "model", None)
    layer = next((m for m in model.modules() if isinstance(m, MoE)), None) if model else None
    if layer is None or layer.backend != "triton":
        return 0
    hidden, calls = layer.w13.shape[-1], 0
    with torch.inference_mode():
        for n in expert_tile_tokens(max_tokens):
            x = 0.1 * torch.randn(n, hidden, dtype=layer.w13.dtype, device=layer.w13.device)
            layer(x)
            calls += 1
    if layer.w13.is_cuda:
        torch.cuda.synchronize()
    return calls


def run_engine_once(
    engine, prompts, out_len: int, dev: Device, probe: LatencyProbe | None, order: bool = False
):
    """Time engine.generate over the prompts between device syncs: (wall s, results with an
    error or a wrong length, results back, TTFTs, ITLs). order: feed them in batchrun.job.order's
    prefix order, what `batchrun submit --order prefix` does, its cost inside the timed run."""
    from batchrun.job.order import order_items
    from batchrun.params import GenerateRequest

    params = greedy_params(out_len)
    requests = [GenerateRequest(str(i), ids, params) for i, ids in enumerate(prompts)]
    if probe is not None:
        probe.first.clear()
    finish: dict[tuple[str, int], float] = {}
    bad = 0
    dev.sync()
    t0 = time.perf_counter()
    if order:
        requests = order_items(requests, lambda r: r.input_ids)
    for result in engine.generate(requests):
        finish[(result.rid, result.index)] = time.perf_counter()
        if result.error or result.completion_tokens != out_len:
            bad += 1
    dev.sync()
    wall = time.perf_counter() - t0
    ttfts, itls = [], []
    if probe is not None and probe.active:
        for key, t_end in finish.items():
            t_first = probe.first.get(key)
            if t_first is None:
                continue
            ttfts.append(t_first - t0)
            if out_len > 1:
                itls.append((t_end - t_first) / (out_len - 1))
    return wall, bad, len(finish), ttfts, itls


def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int, **kwargs):
    """HF `generate` of exactly new_tokens greedy tokens for each of a batch of prompts, padded
    on the left: (the output ids [B, width + new_tokens], width). kwargs go to `generate`
    (logits_processor)."""
    import torch

    width = max(len(p) for p in prompts)
    device = model.device
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=pad_id,
        **kwargs,
    )
    return out, width
