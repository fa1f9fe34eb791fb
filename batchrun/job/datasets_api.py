"""A HuggingFace `datasets.Dataset` in, the same Dataset with completion columns out.

    from batchrun.job.datasets_api import generate_dataset
    from batchrun.params import SamplingParams

    ds = datasets.load_dataset("json", data_files="prompts.jsonl", split="train")
    out = generate_dataset(ds, prompt_column="prompt", model="~/models/Llama-3.1-8B-Instruct",
                           sampling=SamplingParams(max_new_tokens=256, temperature=0))
    out.to_parquet("completions.parquet")

Each row is rendered with the tokenizer's chat template (a user turn, after an optional system
prompt; or the row's own messages with `messages_column`) and goes through one `Engine` in a
single `generate` call, so rows share the prefix cache and are batched continuously. This is
the in-memory path for notebooks and pipelines: nothing is written to disk and nothing resumes.
For big or preemptible runs use `batchrun submit` (sharded, crash-safe output).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from batchrun.chat.parsers import OutputParser, resolve_parsers
from batchrun.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.params import GenerateRequest, SamplingParams

if TYPE_CHECKING:
    import datasets

COLUMNS = ("finish_reason", "prompt_tokens", "completion_tokens")
DEFAULT_SAMPLING = SamplingParams()


def generate_dataset(
    ds: datasets.Dataset,
    prompt_column: str = "prompt",
    *,
    messages_column: str | None = None,
    model: str | None = None,
    sampling: SamplingParams = DEFAULT_SAMPLING,
    system_prompt: str | None = None,
    output_column: str = "completion",
    reasoning_parser: str = "auto",
    engine: Engine | None = None,
    **engine_kw: Any,
) -> datasets.Dataset:
    """Return `ds` with `output_column` (the completion text) and `finish_reason`,
    `prompt_tokens`, `completion_tokens` columns, one value per row, in row order. A thinking
    model's reasoning goes to a `reasoning` column, apart from the answer (`reasoning_parser`:
    auto, none or a name, as `batchrun submit --reasoning-parser`; docs/thinking.md).

    `model` and `engine_kw` (any `EngineConfig` field: device, kv_budget, max_running, ...) build
    the engine; pass `engine` to reuse one. A row that cannot run (too long for the context,
    no tokens, messages with an image or other non-text part) gets completion None and
    finish_reason "error", the rest still run.
    """
    if sampling.n != 1:
        raise ValueError("generate_dataset returns one completion per row; use n=1")
    column = messages_column or prompt_column
    if column not in ds.column_names:
        raise ValueError(f"no column {column!r} in the dataset (columns: {ds.column_names})")
    taken = {output_column, *COLUMNS} & set(ds.column_names)
    if taken:
        raise ValueError(f"the dataset already has columns {sorted(taken)}")
    if engine is None:
        engine = Engine(EngineConfig(model=model, **engine_kw))
    sampling.validate(engine.model_config.vocab_size)
    tokenizer = engine.tokenizer
    # the rows give the template no tools: their answers hold no calls to parse
    parser = OutputParser(tokenizer, resolve_parsers(tokenizer, reasoning_parser, "none"))
    if parser.markers is not None and "reasoning" in ds.column_names:
        raise ValueError("the dataset already has a column 'reasoning'")

    num_rows = len(ds)
    texts: list[str | None] = [None] * num_rows
    finish: list[str] = ["error"] * num_rows
    prompt_tokens = [0] * num_rows
    completion_tokens = [0] * num_rows
    reasoning: list[str | None] = [None] * num_rows
    thinking_open: set[int] = set()  # rows whose prompt opens the thinking block
    requests = _requests(engine, ds, column, messages_column is not None, sampling, system_prompt)
    for r in engine.generate(_marking(requests, parser, thinking_open)):
        i = int(r.rid)
        if r.finish_reason == "abort":  # the engine could not fit it: leave it an error row
            continue
        parsed = parser.parse(r.output_ids, i in thinking_open, with_tools=False)
        texts[i], reasoning[i] = parsed.text, parsed.reasoning
        finish[i] = r.finish_reason
        prompt_tokens[i] = r.prompt_tokens
        completion_tokens[i] = r.completion_tokens
    out = ds.add_column(output_column, texts)
    for name, values in zip(COLUMNS, (finish, prompt_tokens, completion_tokens)):
        out = out.add_column(name, values)
    if parser.markers is not None:
        out = out.add_column("reasoning", reasoning)
    return out


def _marking(
    requests: Iterator[GenerateRequest], parser: OutputParser, thinking_open: set[int]
) -> Iterator[GenerateRequest]:
    """`requests`, adding to `thinking_open` the rows whose prompt opens the thinking block."""
    for request in requests:
        if parser.markers is not None and parser.markers.opens_in(request.input_ids):
            thinking_open.add(int(request.rid))
        yield request


def _requests(
    engine: Engine,
    ds: datasets.Dataset,
    column: str,
    is_messages: bool,
    sampling: SamplingParams,
    system_prompt: str | None,
) -> Iterator[GenerateRequest]:
    """Requests with rid = row number, pulled lazily by the engine (one column read at a time)."""
    tokenizer = engine.tokenizer
    use_template = bool(getattr(tokenizer, "chat_template", None))
    if is_messages and not use_template:
        raise ValueError("messages need a tokenizer with a chat template")
    limit = engine.context_len - sampling.max_new_tokens
    for i, row in enumerate(ds.select_columns([column])):
        value = row[column]
        if is_messages and _has_media(value):
            continue  # an image (or other media) part: batchrun runs the text model; an error row
        if use_template:
            conversation = list(value) if is_messages else [{"role": "user", "content": value}]
            if system_prompt and not is_messages:
                conversation.insert(0, {"role": "system", "content": system_prompt})
            text = tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=False
            )
            # the template already writes BOS where the model wants it
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(value, add_special_tokens=True)["input_ids"]
        if 0 < len(ids) <= limit:
            yield GenerateRequest(str(i), list(ids), sampling)


def _has_media(messages: Any) -> bool:
    """Whether a messages row has a content part that is not text (an image, audio, a file)."""
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            not isinstance(part, dict) or part.get("type") != "text" for part in content
        ):
            return True
    return False
