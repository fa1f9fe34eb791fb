"""A HuggingFace `datasets.Dataset` in, the same Dataset with completion columns out.

    from batchrun.job.datasets_api import generate_dataset
    from batchrun.params import SamplingParams

    ds = datasets.load_dataset("json", data_files="prompts.jsonl", split="train")
    out = generate_dataset(ds, prompt_column="prompt", model="~/models/Llama-3.1-8B-Instruct",
                           sampling=SamplingParams(max_new_tokens=256, temperature=0))
    out.to_parquet("completions.parquet")

Each row is read as `batchrun submit` reads it (its `prompt` text, or its `messages` where the
prompt is null), rendered with the tokenizer's chat template (a user turn after an optional
system prompt, or the row's own messages) and goes through one `Engine` in a
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
from batchrun.io.rows import PreparedRow, RowSpec, prepare_row
from batchrun.io.source import RawRow
from batchrun.job.tokenize import TokenizedRow, tokenize_rows
from batchrun.models.hub import resolve_hub_model
from batchrun.params import GenerateRequest, SamplingParams

if TYPE_CHECKING:
    import datasets

COLUMNS = ("finish_reason", "prompt_tokens", "completion_tokens")
DEFAULT_SAMPLING = SamplingParams()
BATCH_ROWS = 256  # rows prepared and tokenized together


def generate_dataset(
    ds: datasets.Dataset,
    prompt_column: str | None = "prompt",
    *,
    messages_column: str | None = "messages",
    model: str | None = None,
    revision: str | None = None,
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

    A row's prompt is its `prompt_column` text or its `messages_column` chat messages, whichever
    is set (a datasets table gives every row both columns, the other one null), read as
    `batchrun submit` reads them. `model` (a directory, a .gguf, or ORG/NAME in the local
    Hugging Face hub cache, at `revision`: a branch, tag or commit, default main) and
    `engine_kw` (any `EngineConfig` field: device, kv_budget, max_running, ...) build the
    engine; pass `engine` to reuse one. A row that cannot run (no
    prompt, too long for the context, no tokens, messages with an image or other non-text part,
    a chat template that fails on it) gets completion None and finish_reason "error", the rest
    still run.
    """
    if sampling.n != 1:
        raise ValueError("generate_dataset returns one completion per row; use n=1")
    columns = [c for c in (prompt_column, messages_column) if c and c in ds.column_names]
    if not columns:
        wanted = " or ".join(repr(c) for c in (prompt_column, messages_column) if c)
        raise ValueError(
            f"no column {wanted or '(none named)'} in the dataset (columns: {ds.column_names}); "
            "name the prompt's with prompt_column= (text) or messages_column= (chat messages)"
        )
    taken = {output_column, *COLUMNS} & set(ds.column_names)
    if taken:
        raise ValueError(f"the dataset already has columns {sorted(taken)}")
    if engine is None:
        if revision is not None:  # else Engine resolves a hub name at main
            model = str(resolve_hub_model(model, revision)) if model else model
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
    spec = RowSpec(
        prompt_column=prompt_column if prompt_column in columns else None,
        messages_column=messages_column if messages_column in columns else None,
        system_prompt=system_prompt,
    )
    requests = _requests(engine, ds.select_columns(columns), spec, sampling)
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
    engine: Engine, ds: datasets.Dataset, spec: RowSpec, sampling: SamplingParams
) -> Iterator[GenerateRequest]:
    """Requests with rid = row number, pulled lazily by the engine a batch of rows at a time:
    each row prepared and tokenized as `batchrun submit` does it (batchrun.io.rows,
    batchrun.job.tokenize); a row that cannot run yields no request."""
    start = 0
    for batch in ds.iter(batch_size=BATCH_ROWS):
        num = len(next(iter(batch.values())))
        rows = [{k: v[j] for k, v in batch.items()} for j in range(num)]
        prepared = [
            prepare_row(RawRow(start + j, data, None), spec, sampling, openai=False)
            for j, data in enumerate(rows)
        ]
        start += num
        ok = [p for p in prepared if isinstance(p, PreparedRow)]
        for item in tokenize_rows(engine.tokenizer, ok, spec, engine.context_len):
            if isinstance(item, TokenizedRow):
                rid = str(item.prepared.row)
                yield GenerateRequest(rid, list(item.input_ids), sampling)
