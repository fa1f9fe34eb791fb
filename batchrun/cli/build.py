"""What the options of `batchrun submit` / `plan` build: the EngineConfig, the sampling
defaults, the row spec and the structured-output default. Each refuses a bad option with exit 2
(click.UsageError) and a message that names it."""

from __future__ import annotations

import json
from pathlib import Path

import click
from click.core import ParameterSource

from batchrun.config import CUDA_GRAPH_MAX_BS, GPU_MEMORY_UTILIZATION, EngineConfig
from batchrun.errors import ModelConfigError, ModelError
from batchrun.io.row_structured import structured_from_options
from batchrun.io.rows import RowSpec
from batchrun.job.config import SAMPLING_OPTIONS
from batchrun.job.tokenize import check_chat_template
from batchrun.models.hub import is_repo_id, resolve_hub_model
from batchrun.params import SamplingParams
from batchrun.pooling.job_options import PoolingJobOptions, default_task


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
        max_thinking_tokens=o.get("max_thinking_tokens"),
    )
    try:
        params.validate(names=SAMPLING_OPTIONS)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    return params


def _chunk(value: int | None) -> int | str | None:
    """--chunked-prefill-size: not given -> "auto" (the engine's default), 0 -> None
    (unlimited)."""
    if value is None:
        return "auto"
    return value or None


def build_engine_config(o: dict) -> EngineConfig:
    graphs = 0 if o["disable_cuda_graph"] else o.get("cuda_graph_max_bs", CUDA_GRAPH_MAX_BS)
    cfg = EngineConfig(
        model=o["model"],
        load_format=o["load_format"],
        quantization=o.get("quantization"),
        dtype=o["dtype"],
        kv_cache_dtype=o.get("kv_cache_dtype", "auto"),
        linear_state_dtype=o.get("linear_state_dtype", "float32"),
        device=o["device"],
        max_running=o["max_running"],
        kv_budget=o["kv_budget"],
        gpu_memory_utilization=o.get("gpu_memory_utilization", GPU_MEMORY_UTILIZATION),
        chunked_prefill_size=_chunk(o["chunked_prefill_size"]),
        context_len=o.get("max_model_len"),
        enable_radix_cache=not o["no_radix_cache"],
        reference_kernels=o.get("reference_kernels", False),
        dequantize=o.get("dequantize", False),
        pdl=not o["disable_pdl"],
        cuda_graph_max_bs=graphs,
        piecewise_graphs=not o["disable_piecewise_cuda_graph"],
        host_gate=not o["disable_host_gate"],
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
    _check_gpu_memory_utilization(o)
    check_quantization(o)
    return cfg


def _given(name: str) -> bool:
    """Whether the user gave option `name` (not its default)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return False
    return ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)


def _check_gpu_memory_utilization(o: dict) -> None:
    """--gpu-memory-utilization sizes a GPU's KV pool: refused with --kv-budget (which sizes it
    too) and on the CPU (where the pool takes an eighth of the available memory, at most 32k
    tokens)."""
    if not _given("gpu_memory_utilization"):
        return
    if o["kv_budget"] is not None:
        raise click.UsageError(
            "--gpu-memory-utilization and --kv-budget both size the KV pool; give one of them"
        )
    on_cpu = o["device"] == "cpu"
    if o["device"] == "auto":
        import torch

        on_cpu = not torch.cuda.is_available()
    if on_cpu:
        raise click.UsageError(
            "--gpu-memory-utilization sizes the KV pool on a GPU; on the CPU the pool takes an "
            "eighth of the available memory (at most 32,768 tokens): use --kv-budget TOKENS"
        )


def check_quantization(o: dict) -> None:
    """--quantization applies to plain (bf16 / fp16 / fp32) safetensors checkpoints: refused for
    a GGUF model (the embedded one too) and for a checkpoint that is quantized already."""
    quantization, model = o.get("quantization"), o["model"]
    if quantization is None:
        return
    if model is None or model.endswith(".gguf"):
        what = "the embedded model" if model is None else model
        raise click.UsageError(
            f"--quantization {quantization}: {what} is a GGUF model, quantized already; "
            "--quantization quantizes bf16 / fp16 / fp32 safetensors checkpoints"
        )
    config = Path(model).expanduser() / "config.json"
    try:
        raw = json.loads(config.read_text())
    except (OSError, ValueError):
        return  # the engine reports a model it cannot read (exit 4)
    qcfg = raw.get("quantization_config") if isinstance(raw, dict) else None
    if qcfg is not None:
        method = qcfg.get("quant_method") if isinstance(qcfg, dict) else qcfg
        raise click.UsageError(
            f"--quantization {quantization}: {model} is quantized already (config.json's "
            f"quantization_config, quant_method {method!r}); drop the option to run it as it is"
        )


def resolve_model(o: dict) -> str | None:
    """--model as the engine reads it: a name ORG/NAME (not a path here) becomes its snapshot
    directory in the local Hugging Face hub cache at --revision (ModelError, exit 4, when it is
    not there); a path or None (the embedded model) stays."""
    model, revision = o["model"], o.get("revision")
    if model is None or not is_repo_id(model) or Path(model).expanduser().exists():
        if revision is not None:
            what = f"--model {model}" if model is not None else "the embedded model (no --model)"
            raise click.UsageError(
                f"--revision {revision}: picks a snapshot of a --model ORG/NAME in the local "
                f"Hugging Face hub cache, and {what} is not one; drop --revision"
            )
        return model
    try:
        return str(resolve_hub_model(model, revision))
    except ModelConfigError as e:
        raise ModelError(str(e)) from e


def build_spec(o: dict):
    return RowSpec(
        prompt_column=o["prompt_column"] or None,
        messages_column=o["messages_column"] or None,
        id_column=o["id_column"],
        system_prompt=o["system_prompt"],
        use_chat_template=not o["no_chat_template"],
        chat_template=_read_chat_template(o.get("chat_template")),
        keep_columns=tuple(o.get("keep_columns") or ()),
        chat_template_kwargs=o.get("chat_template_kwargs"),
    )


def _read_chat_template(path: str | None) -> str | None:
    """The text of --chat-template FILE; exit 2 when it cannot be read or does not compile."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise click.BadParameter(f"cannot read {path}: {e}", param_hint="--chat-template") from e
    try:
        check_chat_template(text)
    except ValueError as e:
        raise click.BadParameter(f"{path}: {e}", param_hint="--chat-template") from e
    return text


POOLING_FLAGS = {
    "pooling": "--pooling",
    "no_normalize": "--no-normalize",
    "dimensions": "--dimensions",
    "query_prefix": "--query-prefix",
    "raw_scores": "--raw-scores",
    "no_truncate": "--no-truncate",
    "tokenizer_workers": "--tokenizer-workers",
}


def build_pooling(o: dict) -> PoolingJobOptions | None:
    """--task and its options -> PoolingJobOptions (None for generate); a bad combination is a
    UsageError (exit 2) naming what is supported."""
    task = o["task"] or default_task(o["model"])
    if task == "generate":
        given = [flag for key, flag in POOLING_FLAGS.items() if o[key] not in (None, False)]
        if o["embedding_dtype"] != "float32":
            given.append("--embedding-dtype")
        if given:
            raise click.UsageError(
                f"{', '.join(given)} apply to --task embed / rerank / score / classify; this run "
                "generates (pass --task, or a model that embeds or scores)"
            )
        return None
    if o["model"] is None:
        raise click.UsageError(f"--task {task} needs --model (an embedding or scoring model)")
    if o["dp"] > 1 or o["tp"] > 1:
        raise click.UsageError(
            f"--task {task} runs on one device; drop --dp / --tp (several GPUs: --num-shards "
            "with one process per GPU)"
        )
    try:
        return PoolingJobOptions(
            task,
            pooling=o["pooling"],
            normalize=False if o["no_normalize"] else None,
            dimensions=o["dimensions"],
            query_prefix=o["query_prefix"],
            raw_scores=o["raw_scores"],
            truncate=not o["no_truncate"],
            embedding_dtype=o["embedding_dtype"],
            tokenizer_workers=o["tokenizer_workers"],
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from e
