"""The options of `batchrun submit` / `plan`, section by section as `--help` lists them.
batchrun/cli/main.py holds the commands, batchrun/cli/build.py what the options build,
batchrun/cli/sections.py the sections.

Adding an option: one click.option(...) in its section's group; every option has a one-line help
and shows its default (`show_default`: a value, or a description of what happens without it).
"""

from __future__ import annotations

import click

from batchrun.chat.parsers import REASONING_CHOICES, TOOL_CHOICES
from batchrun.cli.sections import option_group
from batchrun.config import (
    CUDA_GRAPH_MAX_BS,
    DEVICES,
    DTYPES,
    GPU_MEMORY_UTILIZATION,
    KV_CACHE_DTYPES,
    LINEAR_STATE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATIONS,
)
from batchrun.engine_process.notify import DEFAULT_MAX_DELAY, DEFAULT_NOTIFY_BATCH
from batchrun.job.order import DEFAULT_WINDOW, ORDERS

# the sections of --help, in this order
INPUT = "Input"
SAMPLING = "Sampling (defaults; a row's own fields win)"
STRUCTURED = "Structured output (for every row; a row's own format wins)"
ENGINE = "Model and engine"
KERNELS = "GPU kernels (CUDA)"
OUTPUT = "Job and output"
PROGRESS = "Progress"
THINKING = "Thinking and tool calls"
TASK = "Task: embed, rerank, score, classify (prefill-only: docs/pooling.md)"

NONE = "none"
MAX_RUNNING_DEFAULT = "512 on CUDA, 1024 there for 3B+ models, 256 on the CPU"


row_options = option_group(
    INPUT,
    click.option(
        "--split",
        metavar="NAME",
        default=None,
        show_default="train, or the only one",
        help="Split of a HF datasets directory.",
    ),
    click.option(
        "--limit",
        metavar="N",
        type=click.IntRange(min=1),
        default=None,
        show_default="all rows",
        help="Read only the first N rows.",
    ),
    click.option(
        "--prompt-column",
        metavar="NAME",
        default="prompt",
        help="Column with the prompt text ('': none).",
    ),
    click.option(
        "--messages-column",
        metavar="NAME",
        default="messages",
        help="Column with chat messages ('': none).",
    ),
    click.option(
        "--id-column",
        metavar="NAME",
        default=None,
        show_default='custom_id, else "id", else the row number',
        help="Column with the row id.",
    ),
    click.option(
        "--system-prompt",
        metavar="TEXT",
        default=None,
        show_default=NONE,
        help="System message for every row that has none.",
    ),
    click.option(
        "--chat-template",
        default=None,
        metavar="FILE",
        show_default="the tokenizer's",
        help="Jinja chat template to render rows with, instead of the tokenizer's.",
    ),
    click.option(
        "--no-chat-template",
        is_flag=True,
        help="Tokenize prompt rows as plain text (messages rows still use the template).",
    ),
)


sampling_options = option_group(
    SAMPLING,
    click.option(
        "--max-tokens", metavar="N", type=int, default=256, help="Most new tokens per completion."
    ),
    click.option(
        "--min-tokens",
        metavar="N",
        type=int,
        default=0,
        help="Tokens before EOS or a stop string may end a completion.",
    ),
    click.option(
        "--temperature",
        metavar="T",
        type=float,
        default=1.0,
        help="Sampling temperature; 0: greedy.",
    ),
    click.option(
        "--top-p",
        metavar="P",
        type=float,
        default=1.0,
        help="Sample from the likeliest tokens of probability mass P; 1: off.",
    ),
    click.option(
        "--top-k",
        metavar="K",
        type=int,
        default=-1,
        help="Sample from the K likeliest tokens; -1: off.",
    ),
    click.option(
        "--min-p",
        metavar="P",
        type=float,
        default=0.0,
        help="Drop tokens less likely than P x the likeliest; 0: off.",
    ),
    click.option(
        "--repetition-penalty",
        metavar="F",
        type=float,
        default=1.0,
        help="HF style, over prompt and output tokens; 1: off.",
    ),
    click.option(
        "--frequency-penalty",
        metavar="F",
        type=float,
        default=0.0,
        help="OpenAI style, per occurrence in the output (-2..2).",
    ),
    click.option(
        "--presence-penalty",
        metavar="F",
        type=float,
        default=0.0,
        help="OpenAI style, once per token in the output (-2..2).",
    ),
    click.option(
        "--stop",
        metavar="TEXT",
        multiple=True,
        show_default=NONE,
        help="Stop string, repeatable (the text ends before it).",
    ),
    click.option("--ignore-eos", is_flag=True, help="Go on past EOS, up to --max-tokens."),
    click.option(
        "--seed",
        metavar="N",
        type=int,
        default=0,
        help="Base seed; a row's derives from it and its id.",
    ),
    click.option(
        "--n", "n", metavar="N", type=click.IntRange(min=1), default=1, help="Completions per row."
    ),
    click.option(
        "--logprobs",
        metavar="N",
        type=click.IntRange(min=0, max=20),
        default=None,
        show_default=NONE,
        help="Write each token's logprob and text, with the N likeliest.",
    ),
)


def _json_object(ctx: click.Context, param: click.Parameter, value: str | None) -> dict | None:
    if value is None:
        return None
    import json

    from batchrun.io.row_chat import check_cli_kwargs

    try:
        return check_cli_kwargs(json.loads(value))
    except ValueError as e:
        raise click.BadParameter(f"{value!r}: {e}", ctx=ctx, param=param) from e


thinking_options = option_group(
    THINKING,
    click.option(
        "--reasoning-parser",
        type=click.Choice(REASONING_CHOICES),
        default="auto",
        help='Write the reasoning apart from the text ("reasoning"); auto: from the tokenizer.',
    ),
    click.option(
        "--tool-call-parser",
        type=click.Choice(TOOL_CHOICES),
        default="auto",
        help='Parse tool calls into "tool_calls"; auto: from the tokenizer.',
    ),
    click.option(
        "--chat-template-kwargs",
        metavar="JSON",
        default=None,
        callback=_json_object,
        show_default=NONE,
        help='Chat template variables for every row, e.g. {"enable_thinking": false}.',
    ),
    click.option(
        "--max-thinking-tokens",
        metavar="N",
        type=click.IntRange(min=1),
        default=None,
        show_default="no budget",
        help="End a row's thinking after N tokens (the model's own way); the answer follows.",
    ),
)


structured_options = option_group(
    STRUCTURED,
    click.option(
        "--response-format",
        default=None,
        metavar="JSON|@FILE",
        show_default=NONE,
        help='OpenAI response_format, e.g. {"type": "json_object"}.',
    ),
    click.option(
        "--json-schema",
        default=None,
        metavar="FILE",
        show_default=NONE,
        help="JSON valid against the schema in FILE.",
    ),
    click.option(
        "--regex",
        metavar="PATTERN",
        default=None,
        show_default=NONE,
        help="Text that matches the regex.",
    ),
    click.option(
        "--choice",
        metavar="TEXT",
        multiple=True,
        show_default=NONE,
        help="One of these strings (repeat, or one JSON list).",
    ),
    click.option(
        "--ebnf",
        default=None,
        metavar="FILE",
        show_default=NONE,
        help="Text in the EBNF grammar of FILE (root rule: root).",
    ),
)


def _not_blank(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not value.strip():
        raise click.BadParameter("give a name (it is empty)", ctx=ctx, param=param)
    return value


model_options = option_group(
    ENGINE,
    click.option(
        "--model",
        "-m",
        default=None,
        metavar="PATH",
        show_default="embedded SmolLM2-135M-Instruct",
        help="HF model dir, .gguf file or hub ORG/NAME.",
    ),
    click.option(
        "--revision",
        default=None,
        metavar="REV",
        help="Branch, tag or commit hash (default: main).",
    ),
    click.option(
        "--load-format",
        type=click.Choice(LOAD_FORMATS),
        default="auto",
        help="How to read the weights; dummy: random, from config.json.",
    ),
    click.option(
        "--quantization",
        type=click.Choice(QUANTIZATIONS),
        default=None,
        show_default="the checkpoint's",
        help="Quantize bf16 linears at load (fp8: per channel, per-token activations).",
    ),
    click.option(
        "--served-model-name",
        default=None,
        metavar="NAME",
        callback=_not_blank,
        show_default="the model's name",
        help='The "model" of OpenAI Batch output lines.',
    ),
)


kernel_options = option_group(
    KERNELS,
    click.option(
        "--reference-kernels",
        is_flag=True,
        help="Plain PyTorch everywhere (the CPU's path): the reference for the fast kernels.",
    ),
    click.option(
        "--dequantize",
        is_flag=True,
        help="Dequantize a quantized checkpoint's weights at load (default: kept quantized "
        "where a kernel runs them faster).",
    ),
    click.option(
        "--kv-cache-dtype",
        type=click.Choice(KV_CACHE_DTYPES),
        default="auto",
        help="KV cache elements; fp8_e4m3: one byte, the checkpoint's k/v scales (else 1.0); "
        "auto: --dtype.",
    ),
    click.option(
        "--linear-state-dtype",
        type=click.Choice(LINEAR_STATE_DTYPES),
        default="float32",
        show_default=True,
        help="A hybrid model's recurrent states (its linear-attention layers); bfloat16 halves "
        "their bytes (docs/hybrid.md: its accuracy).",
    ),
    click.option(
        "--cuda-graph-max-bs",
        type=click.IntRange(min=0),
        default=CUDA_GRAPH_MAX_BS,
        show_default=True,
        metavar="N",
        help="Decode batches up to N rows replay CUDA graphs.",
    ),
    click.option("--disable-cuda-graph", is_flag=True, help="Run every step eagerly."),
    click.option(
        "--disable-piecewise-cuda-graph",
        is_flag=True,
        help="Run prefill and mixed steps eagerly (on by default under 3B parameters).",
    ),
    click.option(
        "--disable-overlap",
        is_flag=True,
        help="Finish each step before scheduling the next.",
    ),
    click.option(
        "--disable-pdl",
        is_flag=True,
        help="No programmatic dependent launch (drivers that reject it).",
    ),
    click.option(
        "--disable-host-gate",
        is_flag=True,
        help="Sample grammar steps after the bitmask fill, without a stream wait.",
    ),
)


engine_options = option_group(
    ENGINE,
    click.option(
        "--device",
        type=click.Choice(DEVICES),
        default="auto",
        help="Where the model runs; auto: cuda if available.",
    ),
    click.option(
        "--dtype",
        type=click.Choice(DTYPES),
        default="auto",
        help="Weights and activations; auto: float32 on CPU, bfloat16 on CUDA.",
    ),
    click.option(
        "--tp",
        metavar="N",
        type=click.IntRange(min=1),
        default=1,
        help="Tensor parallel: split the model over N GPUs.",
    ),
    click.option(
        "--dp",
        metavar="N",
        type=click.IntRange(min=1),
        default=1,
        help="Data parallel: N engine processes, one per GPU (or --tp group).",
    ),
    click.option(
        "--max-running",
        metavar="N",
        type=click.IntRange(min=1),
        default=None,
        show_default=MAX_RUNNING_DEFAULT,
        help="Requests decoded together at most.",
    ),
    click.option(
        "--kv-budget",
        metavar="TOKENS",
        type=click.IntRange(min=16),
        default=None,
        show_default="from --gpu-memory-utilization",
        help="KV pool size in tokens.",
    ),
    click.option(
        "--gpu-memory-utilization",
        metavar="F",
        type=click.FloatRange(min=0, max=1, min_open=True),
        default=GPU_MEMORY_UTILIZATION,
        help="KV pool: this fraction of the GPU memory free after the weights (vLLM: of "
        "the total, for weights and KV).",
    ),
    click.option(
        "--max-model-len",
        metavar="TOKENS",
        type=click.IntRange(min=1),
        default=None,
        show_default="the model's max_position_embeddings",
        help="Context length cap: longer prompt + max_tokens rows go to the errors file.",
    ),
    click.option(
        "--chunked-prefill-size",
        metavar="TOKENS",
        type=click.IntRange(min=0),
        default=None,
        show_default="4096; 12288 for 3B+ models on CUDA",
        help="Prefill tokens per step (0: unlimited).",
    ),
    click.option("--no-radix-cache", is_flag=True, help="Disable prefix caching."),
    click.option(
        "--engine-process/--in-process",
        default=True,
        help="Run the engine in its own process, or in this one (debugging).",
    ),
    click.option(
        "--notify-batch",
        metavar="N",
        type=click.IntRange(min=1),
        default=DEFAULT_NOTIFY_BATCH,
        help=f"Completions per wake-up of the writer (or after {DEFAULT_MAX_DELAY} s).",
    ),
    kernel_options,
)


order_options = option_group(
    OUTPUT,
    click.option(
        "--order",
        type=click.Choice(ORDERS),
        default="prefix",
        help="prefix: rows sharing a prefix back to back (cache hits); input: as read.",
    ),
    click.option(
        "--order-window",
        metavar="N",
        type=click.IntRange(min=1),
        default=DEFAULT_WINDOW,
        help="Rows ordered together (held in memory at once).",
    ),
)


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


task_options = option_group(
    TASK,
    click.option(
        "--task",
        type=click.Choice(["generate", "embed", "rerank", "score", "classify"]),
        default=None,
        show_default="from the model: embed for an encoder / ...Model / sentence-transformers "
        "folder, classify for ...ForSequenceClassification, else generate",
        help="What each row gets: a completion, a vector, scores or label probabilities.",
    ),
    click.option(
        "--pooling",
        type=click.Choice(["mean", "cls", "last"]),
        default=None,
        show_default="the sentence-transformers folder's",
        help="embed: how token states become one vector.",
    ),
    click.option(
        "--no-normalize", is_flag=True, help="embed: keep the vectors' length (no L2 norm)."
    ),
    click.option(
        "--dimensions",
        metavar="N",
        type=click.IntRange(min=1),
        default=None,
        show_default="the model's",
        help="embed: the first N dimensions (Matryoshka), renormalized.",
    ),
    click.option(
        "--query-prefix",
        metavar="TEXT",
        default=None,
        show_default=NONE,
        help="Put before every embed text / score and rerank query (a yes/no reranker: its "
        "instruction).",
    ),
    click.option(
        "--raw-scores", is_flag=True, help="rerank / score: logits, not CrossEncoder's sigmoid."
    ),
    click.option(
        "--no-truncate",
        is_flag=True,
        help="A row longer than max_seq_length is a row error (default: cut, counted).",
    ),
    click.option(
        "--tokenizer-workers",
        metavar="N",
        type=click.IntRange(min=0),
        default=None,
        show_default="half the cores, at most 8; 0 below 4 cores",
        help="embed / rerank / score / classify: processes that tokenize ahead of the engine "
        "(0: the job's process tokenizes).",
    ),
    click.option(
        "--embedding-dtype",
        type=click.Choice(["float32", "float16"]),
        default="float32",
        show_default=True,
        help="embed: element type of the Parquet vectors.",
    ),
)


output_options = option_group(
    OUTPUT,
    click.option(
        "--out",
        "-o",
        metavar="DIR",
        required=True,
        type=click.Path(file_okay=False),
        help="Output directory: results-*.jsonl, errors-*.jsonl, manifest.json.",
    ),
    click.option(
        "--overwrite",
        is_flag=True,
        help="Replace the run in --out (by default the same run resumes).",
    ),
    click.option(
        "--shard-size",
        metavar="N",
        type=click.IntRange(min=1),
        default=10_000,
        help="Rows per output file.",
    ),
    click.option(
        "--token-ids", "with_token_ids", is_flag=True, help="Also write output token ids."
    ),
    click.option(
        "--keep-columns",
        multiple=True,
        callback=parse_columns,
        metavar="COL,...",
        show_default=NONE,
        help='Copy these input columns into every record, under "input" (not for OpenAI Batch).',
    ),
    order_options,
)


run_control_options = option_group(
    OUTPUT,
    click.option(
        "--commit-every",
        metavar="N",
        type=click.IntRange(min=1),
        default=1000,
        help="Commit (fsync + manifest) at least every N rows.",
    ),
    click.option(
        "--commit-interval",
        metavar="SECONDS",
        type=click.FloatRange(min=0),
        default=30.0,
        help="Commit at least every SECONDS too.",
    ),
    click.option(
        "--drain-timeout",
        metavar="SECONDS",
        type=click.FloatRange(min=0),
        default=30.0,
        help="On SIGTERM/INT/USR1: seconds to finish rows in flight, then exit 5.",
    ),
    click.option(
        "--num-shards",
        metavar="N",
        type=click.IntRange(min=1),
        default=None,
        show_default="SLURM_ARRAY_TASK_COUNT, else 1",
        help="Split the input into N shards that keep prefix groups together.",
    ),
    click.option(
        "--shard-index",
        metavar="I",
        type=click.IntRange(min=0),
        default=None,
        show_default="SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN, else 0",
        help="The shard this process runs, into OUT/shard-I/.",
    ),
)


progress_options = option_group(
    PROGRESS,
    click.option("--quiet", "-q", is_flag=True, help="No progress bar."),
    click.option(
        "--serve-progress",
        default=None,
        metavar="HOST:PORT",
        show_default="off",
        help="Serve live progress over HTTP (:PORT binds 127.0.0.1; 0: any free).",
    ),
    click.option(
        "--progress-token",
        default=None,
        envvar="BATCHRUN_PROGRESS_TOKEN",
        show_envvar=True,
        metavar="TOKEN",
        show_default=NONE,
        help="Required on every progress request; needed off loopback.",
    ),
)


plan_engine_options = option_group(
    ENGINE,
    click.option(
        "--device",
        type=click.Choice(DEVICES),
        default="auto",
        help="Where the run would go (as submit's), for the KV bytes.",
    ),
    click.option(
        "--dtype",
        type=click.Choice(DTYPES),
        default="auto",
        help="As submit's (auto: float32 on CPU, bfloat16 on CUDA), for the KV bytes.",
    ),
    click.option(
        "--max-model-len",
        metavar="TOKENS",
        type=click.IntRange(min=1),
        default=None,
        show_default="the model's max_position_embeddings",
        help="Context length cap (as submit's).",
    ),
    click.option(
        "--kv-cache-dtype",
        type=click.Choice(KV_CACHE_DTYPES),
        default="auto",
        show_default=True,
        help="KV cache elements, for the KV bytes (auto: --dtype's; fp8_e4m3: one byte).",
    ),
    click.option(
        "--linear-state-dtype",
        type=click.Choice(LINEAR_STATE_DTYPES),
        default="float32",
        show_default=True,
        help="A hybrid model's recurrent states, for the state bytes (as submit's).",
    ),
    click.option(
        "--kv-budget",
        metavar="TOKENS",
        type=click.IntRange(min=16),
        default=None,
        show_default=NONE,
        help="KV pool size in tokens, to compare the need against.",
    ),
    click.option(
        "--max-running",
        metavar="N",
        type=click.IntRange(min=1),
        default=None,
        show_default=MAX_RUNNING_DEFAULT,
        help="Requests decoded together at most (as the engine).",
    ),
)


plan_report_options = option_group(
    OUTPUT,
    order_options,
    click.option(
        "--show-errors", metavar="N", type=int, default=10, help="How many failing rows to list."
    ),
)
