"""The OpenAI Batch API's `/v1/embeddings` rows: the request body read into texts and options,
and the response body written in the embeddings API's shape.

    body     {"model": ..., "input": "text" | ["text", ...], "dimensions": N,
              "encoding_format": "float" | "base64"}
    response {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": ...}],
              "model": ..., "usage": {"prompt_tokens": n, "total_tokens": n}}

base64 is the vector's float32 little-endian bytes, as the OpenAI API encodes it."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

ENCODING_FORMATS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingsBody:
    texts: tuple[str, ...]
    dimensions: int | None
    encoding_format: str


def read_body(body: dict[str, Any]) -> EmbeddingsBody:
    """The body's texts and options; ValueError (the row's error) names what is wrong."""
    inp = body.get("input")
    if isinstance(inp, str):
        texts = (inp,)
    elif isinstance(inp, list) and inp and all(isinstance(t, str) for t in inp):
        texts = tuple(inp)
    else:
        raise ValueError(
            "body.input must be a string or a non-empty list of strings (token-id inputs are "
            "not supported)"
        )
    fmt = body.get("encoding_format") or "float"
    if fmt not in ENCODING_FORMATS:
        raise ValueError(f"body.encoding_format {fmt!r}; supported: {', '.join(ENCODING_FORMATS)}")
    dims = body.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise ValueError(f"body.dimensions must be a positive integer, got {dims!r}")
    return EmbeddingsBody(texts, dims, fmt)


class Embedding(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class Usage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(msgspec.Struct):
    data: list[Embedding]
    model: str
    usage: Usage
    object: str = "list"


def response_body(
    vectors: np.ndarray, model: str, prompt_tokens: int, encoding_format: str
) -> EmbeddingsResponse:
    """The response of vectors [N, D] (one per input, in the input's order)."""
    vectors = np.ascontiguousarray(vectors, dtype="<f4")
    data = [
        Embedding(
            i,
            base64.b64encode(v.tobytes()).decode("ascii")
            if encoding_format == "base64"
            else v.tolist(),
        )
        for i, v in enumerate(vectors)
    ]
    return EmbeddingsResponse(data, model, Usage(prompt_tokens, prompt_tokens))
