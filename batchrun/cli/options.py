"""The option groups of `batchrun submit` / `plan` and what they build (EngineConfig, sampling
defaults, row spec, grammar). batchrun/cli/main.py holds the commands."""

from __future__ import annotations

import importlib.util

import click

from batchrun.config import (
    ATTENTION_BACKENDS,
    DECODE_GEMVS,
    DEVICES,
    DTYPES,
    LOAD_FORMATS,
    EngineConfig,
    KernelConfig,
)
from batchrun.io.rows import RowSpec, structured_from_options
from batchrun.job.order import DEFAULT_WINDOW, ORDERS
from batchrun.params import SamplingParams


def option_group(*options):
    """One decorator that applies `options` as if they were stacked in the order listed."""

    def apply(f):
        for opt in reversed(options):
            f = opt(f)
        return f

    return apply


# NOTE: listed in the order --help shows them
model_options = option_group(
    click.option(
        "--load-format",
        type=click.Choice(LOAD_FORMATS),
        default="auto",
        show_default=True,
        help="dummy: random weights from config.json.",
    ),
    click.option(
        "--model",
        "-m",
        default=None,
        metavar="PATH",
        help="HF model directory (config.json + safetensors) or a .gguf file. "
        "Default: the embedded SmolLM2-135M-Instruct.",
    ),
)


row_options = option_group(
    click.option("--split", default=None, help="Split of a HF datasets directory."),
    click.option(
        "--prompt-column",
        default="prompt",
        show_default=True,
        help="Column with the prompt text ('' to never read one).",
    ),
    click.option(
        "--messages-column",
        default="messages",
        show_default=True,
        help="Column with chat messages ('' to never read one).",
    ),
    click.option(
        "--id-column",
        default=None,
        help='Column with the row id. Default: custom_id (OpenAI batch), else an "id" '
        "field when a row has one, else the row number.",
    ),
    click.option("--system-prompt", default=None, help="System message for every row."),
    click.option(
        "--no-chat-template",
        is_flag=True,
        help="Tokenize prompt rows as plain text (messages rows still use the template).",
    ),
    click.option(
        "--limit", type=click.IntRange(min=1), default=None, help="Read only the first N rows."
    ),
)


sampling_options = option_group(
    click.option(
        "--max-tokens",
        type=int,
        default=256,
        show_default=True,
        help="Max new tokens per completion.",
    ),
    click.option("--min-tokens", type=int, default=0, show_default=True),
    click.option("--temperature", type=float, default=1.0, show_default=True, help="0 for greedy."),
    click.option("--top-p", type=float, default=1.0, show_default=True),
    click.option("--top-k", type=int, default=-1, show_default=True, help="-1: off."),
    click.option("--min-p", type=float, default=0.0, show_default=True),
    click.option("--repetition-penalty", type=float, default=1.0, show_default=True),
    click.option("--frequency-penalty", type=float, default=0.0, show_default=True),
    click.option("--presence-penalty", type=float, default=0.0, show_default=True),
    click.option("--stop", multiple=True, help="Stop string (repeatable)."),
    click.option("--ignore-eos", is_flag=True, help="Always generate --max-tokens."),
    click.option(
        "--seed",
        type=int,
        default=0,
        show_default=True,
        help="Base seed; each row's seed derives from it and the row id.",
    ),
    click.option(
        "--n",
        "n",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="Completions per row.",
    ),
    click.option(
        "--logprobs",
        type=click.IntRange(min=0, max=20),
        default=None,
        help="Write the chosen token's logprob and the top N (0-20).",
    ),
)


# structured output for every row (a row's response_format / regex / choice / ebnf wins)
structured_options = option_group(
    click.option(
        "--response-format",
        default=None,
        metavar="JSON|@FILE",
        help='OpenAI-style response_format as JSON (or @FILE), e.g. {"type": "json_object"} or '
        '{"type": "json_schema", "json_schema": {"schema": {...}}}.',
    ),
    click.option(
        "--json-schema",
        default=None,
        metavar="FILE",
        help="The output must be JSON valid against the schema in FILE.",
    ),
    click.option("--regex", default=None, help="The output must match this regex."),
    click.option(
        "--choice",
        multiple=True,
        help="The output must be one of these strings (repeat, or one JSON list).",
    ),
    click.option(
        "--ebnf",
        default=None,
        metavar="FILE",
        help="The output must match the EBNF grammar in FILE.",
    ),
)


def build_grammar(o: dict):
    """The structured-output default from the options (None without one); exit 2 if it does
    not parse or compile."""
    try:
        spec = structured_from_options(
            o.get("response_format"),
            o.get("json_schema"),
            o.get("regex"),
            tuple(o.get("choice") or ()),
            o.get("ebnf"),
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    if spec is not None:
        # local: batchrun.engine.grammar imports torch, which `batchrun --help` never loads
        from batchrun.engine.grammar import GrammarError, check_spec

        try:
            check_spec(spec)
        except GrammarError as e:
            names = ("response_format", "json_schema", "regex", "choice", "ebnf")
            option = next(n for n in names if o.get(n))
            raise click.UsageError(f"--{option.replace('_', '-')}: {e}; fix it") from e
    return spec


engine_options = option_group(
    click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True),
    click.option(
        "--tp",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="Tensor parallel: split the model over N GPUs (NCCL; attention heads must divide "
        "by N).",
    ),
    click.option(
        "--dtype",
        type=click.Choice(DTYPES),
        default="auto",
        show_default=True,
        help="auto: float32 on CPU, bfloat16 on CUDA.",
    ),
    click.option(
        "--max-running",
        type=click.IntRange(min=1),
        default=None,
        help="Requests decoded together at most. Default: 512 on CUDA, 1024 for a model of 3B+ "
        "parameters there (its decode matmuls need the rows), 256 on the CPU.",
    ),
    click.option(
        "--kv-budget",
        type=click.IntRange(min=16),
        default=None,
        help="KV pool size in tokens. Default: sized from free memory.",
    ),
    click.option(
        "--chunked-prefill-size",
        type=click.IntRange(min=0),
        default=None,
        help="Prefill tokens per step (0: unlimited). Default: 4096, or 12288 for a model of 3B+ "
        "parameters on CUDA.",
    ),
    click.option("--no-radix-cache", is_flag=True, help="Disable prefix caching."),
    click.option(
        "--attention-backend",
        type=click.Choice(ATTENTION_BACKENDS),
        default="auto",
        show_default=True,
        help="torch: the reference (any device); triton: batchrun's kernels; flashinfer: "
        "FlashInfer's (when installed). auto: triton on CUDA, torch on the CPU.",
    ),
    click.option(
        "--decode-gemv",
        type=click.Choice(DECODE_GEMVS),
        default="auto",
        show_default=True,
        help="CUDA: the matmuls of decode batches of up to 16 requests. triton: batchrun's "
        "kernel, launched with programmatic dependent launch; cublas: torch's. auto: triton on "
        "sm_90+ GPUs (H100, H200), else cublas.",
    ),
    click.option(
        "--disable-cuda-graph",
        is_flag=True,
        help="CUDA: run every step eagerly (no decode graphs, no piecewise graphs).",
    ),
    click.option(
        "--disable-piecewise-cuda-graph",
        is_flag=True,
        help="CUDA: run prefill and mixed steps eagerly (decode graphs stay). Piecewise graphs "
        "are on by default for models under 3B parameters.",
    ),
    click.option(
        "--disable-overlap",
        is_flag=True,
        help="CUDA: process each step's results before scheduling the next (no overlap).",
    ),
    click.option(
        "--disable-pdl",
        is_flag=True,
        help="CUDA: launch batchrun's kernels without programmatic dependent launch (on by "
        "default on sm_90+ GPUs), for drivers that reject it; decode matmuls then take cuBLAS "
        "unless --decode-gemv triton.",
    ),
    click.option(
        "--disable-host-gate",
        is_flag=True,
        help="CUDA: sample a structured-output step once the host has its token bitmask, "
        "instead of queueing it behind a stream wait (for drivers without stream memory "
        "operations).",
    ),
)


order_options = option_group(
    click.option(
        "--order",
        type=click.Choice(ORDERS),
        default="prefix",
        show_default=True,
        help="prefix: run rows sharing a token prefix back to back (depth-first over their "
        "token ids), so the prefix cache hits; input: in input order.",
    ),
    click.option(
        "--order-window",
        type=click.IntRange(min=1),
        default=DEFAULT_WINDOW,
        show_default=True,
        help="Rows read, tokenized and ordered together (held in memory at once).",
    ),
)


run_control_options = option_group(
    click.option(
        "--commit-every",
        type=click.IntRange(min=1),
        default=1000,
        show_default=True,
        help="Commit (fsync + manifest) at least every N rows.",
    ),
    click.option(
        "--commit-interval",
        type=click.FloatRange(min=0),
        default=30.0,
        show_default=True,
        help="... and at least every T seconds.",
    ),
    click.option(
        "--drain-timeout",
        type=click.FloatRange(min=0),
        default=30.0,
        show_default=True,
        help="On SIGTERM/SIGINT/SIGUSR1: seconds to finish the rows in flight before "
        "committing and exiting with code 5.",
    ),
    click.option(
        "--num-shards",
        type=click.IntRange(min=1),
        default=None,
        help="Split the input into N shards that keep prefix groups together. Default: "
        "SLURM_ARRAY_TASK_COUNT, else 1.",
    ),
    click.option(
        "--shard-index",
        type=click.IntRange(min=0),
        default=None,
        help="Which shard this process runs (writes OUT/shard-I/). Default: "
        "SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN, else 0.",
    ),
)


def build_defaults(o: dict) -> SamplingParams:
    params = SamplingParams(
        max_new_tokens=o["max_tokens"],
        min_new_tokens=o["min_tokens"],
        temperature=o["temperature"],
        top_p=o["top_p"],
        top_k=o["top_k"],
        min_p=o["min_p"],
        repetition_penalty=o["repetition_penalty"],
        frequency_penalty=o["frequency_penalty"],
        presence_penalty=o["presence_penalty"],
        stop=tuple(o["stop"]),
        ignore_eos=o["ignore_eos"],
        n=o["n"],
        logprobs=o["logprobs"] is not None,
        top_logprobs=o["logprobs"] or 0,
        grammar=build_grammar(o),
    )
    try:
        params.validate()
    except ValueError as e:
        raise click.UsageError(f"{e} (fix the sampling option)") from e
    return params


def _chunk(value: int | None) -> int | str | None:
    """--chunked-prefill-size: not given -> "auto" (the engine's default), 0 -> None
    (unlimited)."""
    if value is None:
        return "auto"
    return value or None


def build_engine_config(o: dict) -> EngineConfig:
    cfg = EngineConfig(
        model=o["model"],
        load_format=o["load_format"],
        dtype=o["dtype"],
        device=o["device"],
        max_running=o["max_running"],
        kv_budget=o["kv_budget"],
        chunked_prefill_size=_chunk(o["chunked_prefill_size"]),
        enable_radix_cache=not o["no_radix_cache"],
        kernels=KernelConfig(
            attention=o["attention_backend"],
            decode_gemv=o["decode_gemv"],
            pdl=False if o["disable_pdl"] else None,
            cuda_graph_max_bs=0 if o["disable_cuda_graph"] else KernelConfig.cuda_graph_max_bs,
            piecewise_graphs=False if o["disable_piecewise_cuda_graph"] else None,
            host_gate=False if o["disable_host_gate"] else None,
        ),
        overlap=False if o["disable_overlap"] else None,
        seed=o["seed"],
        tp_size=o["tp"],
    )
    try:
        cfg.validate()
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    if o["device"] == "cuda":
        import torch  # local, here and below: only the options that need CUDA load torch

        if not torch.cuda.is_available():
            raise click.UsageError("--device cuda: CUDA is not available here; use --device cpu")
    attention = cfg.kernels.attention
    if attention in ("triton", "flashinfer"):
        import torch

        if o["device"] == "cpu" or not torch.cuda.is_available():
            raise click.UsageError(
                f"--attention-backend {attention} needs a CUDA device; "
                "use --attention-backend torch (or auto) on the CPU"
            )
        if attention == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
            raise click.UsageError(
                "--attention-backend flashinfer: the flashinfer package is not installed "
                "(pip install flashinfer-python); or use triton (or auto)"
            )
    return cfg


def parse_columns(ctx, param, values: tuple[str, ...]) -> tuple[str, ...]:
    """--keep-columns a,b --keep-columns c -> ("a", "b", "c"), each once, in order."""
    names: dict[str, None] = {}
    for value in values:
        for name in value.split(","):
            name = name.strip()
            if not name:
                raise click.BadParameter(
                    f"{value!r} has an empty column name; write COL,COL,... (no empty names)"
                )
            names[name] = None
    return tuple(names)


def build_spec(o: dict):
    return RowSpec(
        prompt_column=o["prompt_column"] or None,
        messages_column=o["messages_column"] or None,
        id_column=o["id_column"],
        system_prompt=o["system_prompt"],
        use_chat_template=not o["no_chat_template"],
        keep_columns=tuple(o.get("keep_columns") or ()),
    )
