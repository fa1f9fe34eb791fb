"""vLLM's score and rerank bodies in OpenAI Batch rows (`url` /v1/score, /score, /v1/rerank,
/rerank, /v2/rerank, as vLLM's run-batch accepts them), read into (query, document) pairs, and
their responses in vLLM's shapes.

    score    {"model": ..., "text_1": str | [str], "text_2": str | [str]}
             1:1, 1:N (text_1 goes with each text_2) or N:N (pairwise)
             -> {"id": "score-...", "object": "list", "created": t, "model": ...,
                 "data": [{"index": i, "object": "score", "score": s}],
                 "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}}
    rerank   {"model": ..., "query": str, "documents": [str], "top_n": k,
              "return_documents": bool}
             -> {"id": "rerank-...", "model": ...,
                 "results": [{"index": i, "document": {"text": ...}, "relevance_score": s}],
                 "usage": {"prompt_tokens": n, "total_tokens": n}}
             results by relevance_score, highest first; the first top_n (0: all); documents
             given back unless return_documents is false."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

SCORE_URLS = ("/v1/score", "/score")
RERANK_URLS = ("/v1/rerank", "/rerank", "/v2/rerank")


@dataclass(frozen=True)
class ScoreBody:
    pairs: tuple[tuple[str, str], ...]  # (query, document), in the response's index order
    rerank: bool
    top_n: int = 0  # rerank: keep the best top_n (0: all)
    return_documents: bool = True


def _texts(body: dict[str, Any], name: str) -> list[str]:
    value = body.get(name)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    raise ValueError(f"body.{name} must be a string or a non-empty list of strings")


def read_score_body(url: str, body: dict[str, Any]) -> ScoreBody:
    """ValueError naming the field and what it may be."""
    if url in SCORE_URLS:
        text_1, text_2 = _texts(body, "text_1"), _texts(body, "text_2")
        if len(text_1) == 1:
            text_1 = text_1 * len(text_2)
        elif len(text_1) != len(text_2):
            raise ValueError(
                f"body.text_1 has {len(text_1)} texts and body.text_2 {len(text_2)}: give 1:1, "
                "1:N or N:N texts"
            )
        return ScoreBody(tuple(zip(text_1, text_2, strict=True)), rerank=False)
    query, documents = body.get("query"), body.get("documents")
    if not isinstance(query, str):
        raise ValueError("body.query must be a string")
    if not isinstance(documents, list) or not documents:
        raise ValueError("body.documents must be a non-empty list of strings")
    if not all(isinstance(d, str) for d in documents):
        raise ValueError("body.documents must be strings (multimodal documents: not supported)")
    top_n = body.get("top_n") or 0
    if not isinstance(top_n, int) or top_n < 0:
        raise ValueError(f"body.top_n must be an integer >= 0; got {top_n!r}")
    return_documents = body.get("return_documents", True)
    if not isinstance(return_documents, bool):
        raise ValueError("body.return_documents must be true or false")
    pairs = tuple((query, d) for d in documents)
    return ScoreBody(pairs, rerank=True, top_n=top_n, return_documents=return_documents)


def score_response(
    body: ScoreBody, scores: list[float], model: str, prompt_tokens: int
) -> dict[str, Any]:
    """The response body of `scores` (one per pair, in body.pairs' order)."""
    if not body.rerank:
        return {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                      "completion_tokens": 0},
        }  # fmt: skip
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if body.top_n:
        order = order[: body.top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i}
        if body.return_documents:
            result["document"] = {"text": body.pairs[i][1]}
        result["relevance_score"] = scores[i]
        results.append(result)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        "results": results,
    }
