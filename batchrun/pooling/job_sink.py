"""Where a finished pooling row goes: an embed row's vector to the run's vector shards (Parquet,
committed with the ledger), a score / rerank / classify row's record to the results JSONL, a row
that cannot run to the errors shard; the row is counted in the summary and on the bar."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from batchrun.io.records import encode_line, error_record, openai_error_record
from batchrun.io.rows import PreparedRow, RowError
from batchrun.job.commit import RunOutput
from batchrun.job.summary import RunSummary
from batchrun.pooling.job_engine import PooledRow
from batchrun.pooling.job_options import PoolingJobOptions
from batchrun.pooling.openai_embeddings import response_body
from batchrun.pooling.openai_scores import score_response
from batchrun.progress.bar import Progress

if TYPE_CHECKING:
    from batchrun.progress.hub import ProgressHub

_encoder = msgspec.json.Encoder()


class PoolingSink:
    def __init__(
        self,
        options: PoolingJobOptions,
        labels: tuple[str, ...],
        output: RunOutput,
        summary: RunSummary,
        hub: ProgressHub | None,
        model_name: str,
    ) -> None:
        self.options, self.labels, self.model_name = options, labels, model_name
        self.output, self.summary, self.hub = output, summary, hub
        self.progress = Progress(None, quiet=True)  # the runner's bar once the run starts

    def results(self, prepared: PreparedRow, pooled: PooledRow) -> None:
        s = self.summary
        s.rows += 1
        s.rows_ok += 1
        s.completions += 1
        s.prompt_tokens += pooled.num_tokens
        s.cached_tokens += pooled.num_shared  # computed once for several sequences
        task = self.options.task
        if prepared.openai:
            lines = [self._openai_line(prepared, pooled)]
            self.output.add_result(prepared.row, lines)
        elif task == "embed":
            vector = pooled.values[0].numpy().astype(np.float32, copy=False)
            self.output.add_vector(prepared.row, prepared.id, vector)
            lines: list[bytes] = []
        else:
            record = {"id": prepared.id, **self._record(pooled)}
            record["usage"] = {"prompt_tokens": pooled.num_tokens}
            if prepared.kept is not None:
                record["input"] = prepared.kept
            lines = [_encoder.encode(record) + b"\n"]
            self.output.add_result(prepared.row, lines)
        self.progress.rows(1)
        if self.hub is not None:
            self.hub.add_rows(lines)
            self.hub.update(s)

    def _openai_line(self, prepared: PreparedRow, pooled: PooledRow) -> bytes:
        """An OpenAI Batch row's output line, in its url's response shape."""
        model = prepared.extra.get("model") or self.model_name
        score_body = prepared.extra.get("score_body")
        if score_body is not None:
            scores = [float(v.reshape(-1)[0]) for v in pooled.values]
            body = score_response(score_body, scores, model, pooled.num_tokens)
        else:
            body = self._embeddings_body(prepared, pooled, model)
        hex_id = uuid.uuid4().hex
        record = {
            "id": f"batch_req_{hex_id}",
            "custom_id": prepared.id,
            "response": {"status_code": 200, "request_id": hex_id, "body": body},
            "error": None,
        }
        return _encoder.encode(record) + b"\n"

    def _embeddings_body(self, prepared: PreparedRow, pooled: PooledRow, model: str):
        """The embeddings response; body.dimensions keeps the first N and renormalizes, as the
        API does."""
        vectors = np.stack([v.numpy() for v in pooled.values]).astype(np.float32)
        dims = prepared.extra.get("dimensions")
        if dims is not None:
            vectors = vectors[:, :dims]
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)
        return response_body(vectors, model, pooled.num_tokens, prepared.extra["encoding_format"])

    def _record(self, pooled: PooledRow) -> dict:
        task, values = self.options.task, pooled.values
        if task == "score":
            return {"score": _scalar_or_list(values[0])}
        if task == "rerank":
            return {"scores": [_scalar_or_list(v) for v in values]}
        logits = values[0].float()
        if len(self.labels) == 1:  # a reward model: one scalar per conversation
            return {"score": float(logits.reshape(-1)[0])}
        probs = logits.softmax(-1)
        return {"probs": probs.tolist(), "label": self.labels[int(probs.argmax())]}

    def error(self, error: RowError, openai: bool = False) -> None:
        self.summary.add_error(error.type)
        line = encode_line(openai_error_record(error) if openai else error_record(error))
        self.output.add_error(error.row, line)
        self.progress.rows(1)
        if self.hub is not None:
            self.hub.update(self.summary)
            self.hub.add_error(error.row, error.id, error.type, error.message)
            self.hub.add_rows([line])


def _scalar_or_list(value) -> float | list[float]:
    """A one-label head's score is a number; a wider head's, one per label."""
    return float(value) if value.numel() == 1 else value.float().tolist()
