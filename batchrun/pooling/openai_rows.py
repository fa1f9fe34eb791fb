"""OpenAI Batch rows of a pooling task (`custom_id`, `url`, `body`) -> token rows, or a RowError:
`/v1/embeddings` with --task embed (pooling/openai_embeddings.py reads the body), vLLM's score
and rerank bodies with --task score or rerank (pooling/openai_scores.py): one sequence per
(query, document) pair. The response's shape follows the url (job_sink.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchrun.io.rows import PreparedRow, RowError
from batchrun.params import SamplingParams
from batchrun.pooling.openai_embeddings import read_body
from batchrun.pooling.openai_scores import RERANK_URLS, SCORE_URLS, read_score_body

if TYPE_CHECKING:
    from batchrun.pooling.row_tokens import PoolingRow, RowConverter

EMBEDDINGS_URL = "/v1/embeddings"


class BadRow(ValueError):
    """A row's content that cannot run: its message goes to the errors shard."""


def openai_row(converter: RowConverter, data: dict, row: int) -> PoolingRow | RowError:
    from batchrun.pooling.row_tokens import PoolingRow

    row_id = str(data.get("custom_id", row))
    url, body = data.get("url"), data.get("body") or {}
    try:
        if url in SCORE_URLS + RERANK_URLS:
            token_rows, extra = _scores(converter, url, body)
        else:
            token_rows, extra = _embeddings(converter, url, body)
        converter.check_length(token_rows)
    except BadRow as e:
        return RowError(row_id, row, "invalid_request", f"row {row}: {e}", None)
    extra = {"url": url, "model": body.get("model"), **extra}
    prepared = PreparedRow(row_id, row, None, None, SamplingParams(), True, None, extra)
    return PoolingRow(prepared, token_rows, list(token_rows[0].input_ids))


def _embeddings(converter: RowConverter, url: object, body: dict) -> tuple[tuple, dict]:
    task = converter.options.task
    if task != "embed" or url != EMBEDDINGS_URL:
        urls = ", ".join(SCORE_URLS + RERANK_URLS)
        raise BadRow(
            f"url {url!r} with --task {task}; OpenAI Batch rows of a pooling task are "
            f"{EMBEDDINGS_URL} with --task embed, or {urls} with --task score or rerank"
        )
    try:
        parsed = read_body(body)
    except ValueError as e:
        raise BadRow(str(e)) from None
    width = converter.recipe.width
    if parsed.dimensions is not None and parsed.dimensions > width:
        raise BadRow(f"body.dimensions {parsed.dimensions}: the vectors have {width}")
    prefix = converter.options.query_prefix or ""
    token_rows = tuple(converter.one(t, None, prefix) for t in parsed.texts)
    extra = {"dimensions": parsed.dimensions, "encoding_format": parsed.encoding_format}
    return token_rows, extra


def _scores(converter: RowConverter, url: str, body: dict) -> tuple[tuple, dict]:
    task = converter.options.task
    if task not in ("score", "rerank"):
        raise BadRow(f"url {url!r} with --task {task}: score and rerank rows need --task score "
                     "or --task rerank")  # fmt: skip
    if not converter.recipe.scalar_scores:
        raise BadRow(
            f"url {url!r}: the model's head gives several logits per pair, the response one "
            "score (use a one-label cross-encoder or a yes/no reranker)"
        )
    try:
        parsed = read_score_body(url, body)
    except ValueError as e:
        raise BadRow(str(e)) from None
    prefix = converter.options.query_prefix or ""
    token_rows = tuple(converter.pair(q, d, prefix) for q, d in parsed.pairs)
    return token_rows, {"score_body": parsed}
