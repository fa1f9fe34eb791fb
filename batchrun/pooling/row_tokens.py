"""One input row of a pooling task -> its token rows, or a RowError: the per-row half of
job_rows.py, run in the job's process or in a tokenizer worker process (the job's rows in
batches, `convert_batch`).

    embed      a `text` / `input` column (or --prompt-column)           one sequence
    score      `query` + `document`, or `text_1` + `text_2`              one pair
    rerank     `query` + `documents` (a list of strings)                one pair per document
    classify   a text column, or `messages` (the chat template applied)  one sequence

OpenAI Batch rows (pooling/openai_rows.py reads their bodies) give the sequences of their url."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from batchrun.io.rows import PreparedRow, RowError, RowSpec, given_id, kept_columns
from batchrun.io.source import RawRow
from batchrun.params import SamplingParams
from batchrun.pooling.job_options import PoolingJobOptions
from batchrun.pooling.model import RowTokenizer, TokenRow
from batchrun.pooling.openai_rows import BadRow, openai_row

TEXT_COLUMNS = ("text", "input")


class PoolingRow(NamedTuple):
    prepared: PreparedRow
    token_rows: tuple[TokenRow, ...]  # one per sequence (rerank: one per document)
    input_ids: list[int]  # the first sequence's (shards and prefix order key on it)


@dataclass(frozen=True)
class RowRecipe:
    """What converting a row needs besides the tokenizer (a worker loads that from model_dir)."""

    options: PoolingJobOptions
    spec: RowSpec
    model_dir: str
    max_len: int
    kind: str  # encoder / decoder
    head: str  # base / classify / lm (a yes/no reranker)
    width: int  # the vectors' dimensions (--dimensions, else the model's)
    scalar_scores: bool  # a score is one number (a yes/no reranker, a one-label head)


class RowConverter:
    def __init__(self, recipe: RowRecipe, tokenizer) -> None:
        self.recipe, self.options, self.spec = recipe, recipe.options, recipe.spec
        self.tokenizer = tokenizer
        self.row_tokenizer = RowTokenizer(tokenizer, recipe.max_len, recipe.kind)

    def convert(self, raw: RawRow, openai: bool) -> PoolingRow | RowError:
        kept = kept_columns(raw.data, self.spec.keep_columns)
        if raw.data is None:
            return RowError(str(raw.row), raw.row, raw.kind, raw.error or "row could not be parsed",
                            kept)  # fmt: skip
        if openai:
            return openai_row(self, raw.data, raw.row)
        row_id = given_id(raw.data, self.spec.id_column) or str(raw.row)
        try:
            token_rows = self.tokenize(raw.data)
        except BadRow as e:
            kind = "context_length_exceeded" if "--no-truncate" in str(e) else "invalid_request"
            return RowError(row_id, raw.row, kind, f"row {raw.row}: {e}", kept)
        prepared = PreparedRow(row_id, raw.row, None, None, SamplingParams(), False, None, {},
                               kept=kept)  # fmt: skip
        return PoolingRow(prepared, token_rows, list(token_rows[0].input_ids))

    def tokenize(self, data: dict) -> tuple[TokenRow, ...]:
        task, prefix = self.options.task, self.options.query_prefix or ""
        if task == "embed":
            rows = (self.one(self._text(data), None, prefix),)
        elif task == "classify":
            messages = data.get(self.spec.messages_column or "messages")
            if messages is not None and self._text_column(data) is None:
                rows = (self.one(self._chat(messages), None, ""),)
            else:
                rows = (self.one(self._text(data), None, ""),)
        elif task == "score":
            if "text_1" in data or "text_2" in data:
                query, doc = string(data, "text_1"), string(data, "text_2")
            else:
                query, doc = string(data, "query"), string(data, "document")
            rows = (self.pair(query, doc, prefix),)
        else:  # rerank
            query, docs = string(data, "query"), data.get("documents")
            rows = self.pairs(query, docs, prefix)
        return self.check_length(rows)

    def check_length(self, rows: tuple[TokenRow, ...]) -> tuple[TokenRow, ...]:
        if not self.options.truncate and any(r.truncated for r in rows):
            raise BadRow(
                f"longer than the model's {self.recipe.max_len} tokens (--no-truncate: such "
                "rows fail instead of being cut)"
            )
        return rows

    def one(self, text: str, pair: str | None, prefix: str) -> TokenRow:
        try:
            return self.row_tokenizer.tokenize(text, pair, prefix or None)
        except ValueError as e:
            raise BadRow(str(e)) from None

    def pair(self, query: str, document: str, prefix: str) -> TokenRow:
        if not query or not document:
            raise BadRow("an empty query or document: nothing to score")
        if self.recipe.head == "lm":  # a yes/no reranker: its prompt, the prefix its instruction
            return self.row_tokenizer.tokenize_yes_no(query, document, prefix or None)
        return self.one(prefix + query, document, "")

    def pairs(self, query: str, docs: object, prefix: str) -> tuple[TokenRow, ...]:
        if not isinstance(docs, list) or not docs:
            raise BadRow("rerank needs `documents`: a non-empty list of strings")
        if not all(isinstance(d, str) for d in docs):
            raise BadRow("every item of `documents` must be a string")
        return tuple(self.pair(query, d, prefix) for d in docs)

    def _text_column(self, data: dict) -> str | None:
        names = (
            (self.spec.prompt_column, *TEXT_COLUMNS) if self.spec.prompt_column else TEXT_COLUMNS
        )
        return next((c for c in names if c in data), None)

    def _text(self, data: dict) -> str:
        column = self._text_column(data)
        if column is None:
            names = ", ".join(c for c in (self.spec.prompt_column, *TEXT_COLUMNS) if c)
            raise BadRow(f"no text column (looked for {names}; --prompt-column names another)")
        return string(data, column)

    def _chat(self, messages: object) -> str:
        if not isinstance(messages, list) or not messages:
            raise BadRow("`messages` must be a non-empty list of {role, content}")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template error is the row's
            raise BadRow(f"the chat template cannot format `messages`: {e}") from None


def string(data: dict, column: str) -> str:
    value = data.get(column)
    if value is None:
        raise BadRow(f"no `{column}` field")
    if not isinstance(value, str):
        raise BadRow(f"`{column}` must be a string, got {type(value).__name__}")
    return value


def watch_parent(parent_pid: int) -> None:
    """A tokenizer worker's initializer: the worker exits once the job's process is gone (killed
    with SIGKILL, it leaves its idle workers blocked on their task queue otherwise)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


@lru_cache(maxsize=1)
def _worker_tokenizer(model_dir: str):
    """A worker process's tokenizer, loaded once (by `warm` while the job loads its model)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def warm(model_dir: str) -> None:
    """A tokenizer worker's first task: its imports and the tokenizer, before rows come."""
    _worker_tokenizer(model_dir)


@lru_cache(maxsize=1)
def _worker_converter(recipe: RowRecipe) -> RowConverter:
    return RowConverter(recipe, _worker_tokenizer(recipe.model_dir))


def convert_batch(
    recipe: RowRecipe, batch: list[RawRow], openai: bool
) -> tuple[list[PoolingRow | RowError], float]:
    """A tokenizer worker's task: a batch of rows converted in order, and the seconds it took."""
    converter = _worker_converter(recipe)
    start = time.perf_counter()
    out = [converter.convert(raw, openai) for raw in batch]
    return out, time.perf_counter() - start
