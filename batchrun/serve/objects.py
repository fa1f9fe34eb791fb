"""The OpenAI objects as the API returns them: file, batch, list page, error."""

from __future__ import annotations

import time

from aiohttp import web

from batchrun.serve.store import new_id


def file_object(row: dict) -> dict:
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def new_batch(
    input_file_id: str, endpoint: str, window: str, window_s: int, metadata: dict | None
) -> dict:
    now = int(time.time())
    return {
        "id": new_id("batch_"),
        "object": "batch",
        "endpoint": endpoint,
        "model": None,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": window,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": now,
        "in_progress_at": None,
        "expires_at": now + window_s,
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": metadata,
    }


def page(data: list[dict], has_more: bool) -> dict:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def error(status: int, message: str, param: str | None = None, code: str | None = None):
    """An HTTP error with OpenAI's error body ({"error": {message, type, param, code}})."""
    kinds = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error"}
    body = {
        "error": {
            "message": message,
            "type": kinds.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }
    return web.json_response(body, status=status)
