"""Input rows of a pooling task -> tokenized rows, as the job's RowPipeline does for generate.

    embed      a `text` / `input` column (or --prompt-column)           one sequence
    score      `query` + `document`, or `text_1` + `text_2`              one pair
    rerank     `query` + `documents` (a list of strings)                one pair per document
    classify   a text column, or `messages` (the chat template applied)  one sequence

OpenAI Batch rows (`custom_id`, `url` /v1/embeddings, `body.input` a string or a list) embed
their texts (pooling/openai_embeddings.py reads the body); their results go to the JSONL output
in the embeddings response shape. A row that cannot run (no such column, an empty text, a pair
without its document, longer than the model with --no-truncate) becomes a RowError naming its
row number and why; the job goes on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from batchrun.io.readers import DatasetSource
from batchrun.io.rows import (
    PreparedRow,
    RowError,
    RowSpec,
    detect_openai_batch,
    given_id,
    kept_columns,
)
from batchrun.job.pipeline import read_rows
from batchrun.params import SamplingParams
from batchrun.pooling.job_options import PoolingJobOptions
from batchrun.pooling.model import PoolingModel, TokenRow
from batchrun.pooling.openai_embeddings import read_body

EMBEDDINGS_URL = "/v1/embeddings"

TEXT_COLUMNS = ("text", "input")


class PoolingRow(NamedTuple):
    prepared: PreparedRow
    token_rows: tuple[TokenRow, ...]  # one per sequence (rerank: one per document)
    input_ids: list[int]  # the first sequence's (shards and prefix order key on it)


class BadRow(ValueError):
    """A row's content that cannot run: its message goes to the errors shard."""


class PoolingRows:
    def __init__(self, source: DatasetSource, spec: RowSpec, options: PoolingJobOptions,
                 model: PoolingModel, limit: int | None, batch_size: int) -> None:  # fmt: skip
        self.source, self.spec, self.options, self.model = source, spec, options, model
        self.limit, self.batch_size = limit, batch_size
        self.num_truncated = 0  # rows cut to max_seq_length
        self.openai: bool | None = None  # OpenAI Batch input (known from the first parsed row)
        self.unseen_columns: set[str] = set()  # (the runner's warning about kept columns)

    def __iter__(self) -> Iterator[PoolingRow | RowError]:
        for batch in read_rows(self.source, self.limit, self.batch_size):
            for raw in batch:
                kept = kept_columns(raw.data, self.spec.keep_columns)
                if raw.data is None:
                    message = raw.error or "row could not be parsed"
                    yield RowError(str(raw.row), raw.row, raw.kind, message, kept)
                    continue
                if self.openai is None:
                    self.openai = detect_openai_batch(raw.data)
                if self.openai:
                    yield self._openai(raw.data, raw.row)
                    continue
                row_id = given_id(raw.data, self.spec.id_column) or str(raw.row)
                try:
                    token_rows = self._tokenize(raw.data)
                except BadRow as e:
                    kind = "context_length_exceeded" if "--no-truncate" in str(e) else None
                    yield RowError(row_id, raw.row, kind or "invalid_request",
                                   f"row {raw.row}: {e}", kept)  # fmt: skip
                    continue
                self.num_truncated += any(t.truncated for t in token_rows)
                prepared = PreparedRow(row_id, raw.row, None, None, SamplingParams(), False,
                                       None, {}, kept=kept)  # fmt: skip
                yield PoolingRow(prepared, token_rows, list(token_rows[0].input_ids))

    def truncation_note(self) -> str:
        return (
            f"{self.num_truncated:,} rows of this attempt were longer than the model's "
            f"{self.model.max_len} tokens and were cut as sentence-transformers cuts them "
            "(--no-truncate makes them row errors)"
        )

    def _openai(self, data: dict, row: int) -> PoolingRow | RowError:
        row_id = str(data.get("custom_id", row))
        try:
            if self.options.task != "embed" or data.get("url") != EMBEDDINGS_URL:
                raise BadRow(
                    f"url {data.get('url')!r} with --task {self.options.task}; OpenAI Batch input "
                    f"of a pooling task must be {EMBEDDINGS_URL} rows with --task embed"
                )
            try:
                body = read_body(data.get("body") or {})
            except ValueError as e:
                raise BadRow(str(e)) from None
            width = self.options.dimensions or self.model.hidden_size
            if body.dimensions is not None and body.dimensions > width:
                raise BadRow(f"body.dimensions {body.dimensions}: the vectors have {width}")
            prefix = self.options.query_prefix or ""
            token_rows = tuple(self._one(t, None, prefix) for t in body.texts)
        except BadRow as e:
            return RowError(row_id, row, "invalid_request", f"row {row}: {e}", None)
        self.num_truncated += any(t.truncated for t in token_rows)
        extra = {
            "url": EMBEDDINGS_URL,
            "model": data["body"].get("model"),
            "dimensions": body.dimensions,
            "encoding_format": body.encoding_format,
        }
        prepared = PreparedRow(row_id, row, None, None, SamplingParams(), True, None, extra)
        return PoolingRow(prepared, token_rows, list(token_rows[0].input_ids))

    # -- one row ---------------------------------------------------------------------------------

    def _tokenize(self, data: dict) -> tuple[TokenRow, ...]:
        task, prefix = self.options.task, self.options.query_prefix or ""
        if task == "embed":
            rows = (self._one(self._text(data), None, prefix),)
        elif task == "classify":
            messages = data.get(self.spec.messages_column or "messages")
            if messages is not None and self._text_column(data) is None:
                rows = (self._one(self._chat(messages), None, ""),)
            else:
                rows = (self._one(self._text(data), None, ""),)
        elif task == "score":
            if "text_1" in data or "text_2" in data:
                query, doc = _string(data, "text_1"), _string(data, "text_2")
            else:
                query, doc = _string(data, "query"), _string(data, "document")
            rows = (self._pair(query, doc, prefix),)
        else:  # rerank
            query, docs = _string(data, "query"), data.get("documents")
            if not isinstance(docs, list) or not docs:
                raise BadRow("rerank needs `documents`: a non-empty list of strings")
            if not all(isinstance(d, str) for d in docs):
                raise BadRow("every item of `documents` must be a string")
            rows = tuple(self._pair(query, d, prefix) for d in docs)
        if not self.options.truncate and any(r.truncated for r in rows):
            raise BadRow(
                f"longer than the model's {self.model.max_len} tokens (--no-truncate: such "
                "rows fail instead of being cut)"
            )
        return rows

    def _one(self, text: str, pair: str | None, prefix: str) -> TokenRow:
        try:
            return self.model.tokenize(text, pair, prefix or None)
        except ValueError as e:
            raise BadRow(str(e)) from None

    def _pair(self, query: str, document: str, prefix: str) -> TokenRow:
        if not query or not document:
            raise BadRow("an empty query or document: nothing to score")
        if self.model.head == "lm":  # a yes/no reranker: its own prompt, the prefix its instruction
            return self.model.tokenize_yes_no(query, document, prefix or None)
        return self._one(prefix + query, document, "")

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
        return _string(data, column)

    def _chat(self, messages: object) -> str:
        if not isinstance(messages, list) or not messages:
            raise BadRow("`messages` must be a non-empty list of {role, content}")
        try:
            return self.model.tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template error is the row's
            raise BadRow(f"the chat template cannot format `messages`: {e}") from None


def _string(data: dict, column: str) -> str:
    value = data.get(column)
    if value is None:
        raise BadRow(f"no `{column}` field")
    if not isinstance(value, str):
        raise BadRow(f"`{column}` must be a string, got {type(value).__name__}")
    return value
