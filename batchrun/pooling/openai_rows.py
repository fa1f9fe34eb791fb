"""OpenAI Batch rows of a pooling task (`custom_id`, `url`, `body`) -> token rows, or a RowError:
`/v1/embeddings` with --task embed (pooling/openai_embeddings.py reads the body)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchrun.io.rows import PreparedRow, RowError
from batchrun.params import SamplingParams
from batchrun.pooling.openai_embeddings import read_body

if TYPE_CHECKING:
    from batchrun.pooling.row_tokens import PoolingRow, RowConverter

EMBEDDINGS_URL = "/v1/embeddings"


class BadRow(ValueError):
    """A row's content that cannot run: its message goes to the errors shard."""


def openai_row(converter: RowConverter, data: dict, row: int) -> PoolingRow | RowError:
    from batchrun.pooling.row_tokens import PoolingRow

    row_id = str(data.get("custom_id", row))
    task = converter.options.task
    try:
        if task != "embed" or data.get("url") != EMBEDDINGS_URL:
            raise BadRow(
                f"url {data.get('url')!r} with --task {task}; OpenAI Batch input "
                f"of a pooling task must be {EMBEDDINGS_URL} rows with --task embed"
            )
        try:
            body = read_body(data.get("body") or {})
        except ValueError as e:
            raise BadRow(str(e)) from None
        width = converter.recipe.width
        if body.dimensions is not None and body.dimensions > width:
            raise BadRow(f"body.dimensions {body.dimensions}: the vectors have {width}")
        prefix = converter.options.query_prefix or ""
        token_rows = tuple(converter.one(t, None, prefix) for t in body.texts)
        converter.check_length(token_rows)
    except BadRow as e:
        return RowError(row_id, row, "invalid_request", f"row {row}: {e}", None)
    extra = {
        "url": EMBEDDINGS_URL,
        "model": data["body"].get("model"),
        "dimensions": body.dimensions,
        "encoding_format": body.encoding_format,
    }
    prepared = PreparedRow(row_id, row, None, None, SamplingParams(), True, None, extra)
    return PoolingRow(prepared, token_rows, list(token_rows[0].input_ids))
