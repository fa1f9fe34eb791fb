"""Watching the server: the running batch's live page, SSE stream and metrics (passed on from
its progress server on loopback), and /metrics with the queue."""

from __future__ import annotations

import aiohttp
from aiohttp import web

STATUSES = (
    "validating", "in_progress", "finalizing", "cancelling",
    "completed", "failed", "expired", "cancelled",
)  # fmt: skip


async def proxy_progress(
    session: aiohttp.ClientSession, request: web.Request, url: str, token: str
) -> web.StreamResponse:
    """GET `url` + the tail (page, events, metrics), streamed back as it comes (SSE)."""
    query = {k: v for k, v in request.query.items() if k != "token"}
    target = url + request.match_info.get("tail", "")
    try:
        async with session.get(
            target, params=query, headers={"Authorization": f"Bearer {token}"}
        ) as upstream:
            resp = web.StreamResponse(
                status=upstream.status,
                headers={
                    "Content-Type": upstream.headers.get("Content-Type", "text/plain"),
                    "Cache-Control": "no-cache",
                },
            )
            await resp.prepare(request)
            async for chunk in upstream.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp
    except aiohttp.ClientError:
        raise web.HTTPServiceUnavailable(text="the batch's progress ended\n") from None


def metrics_text(counts: dict[str, int], running: str | None, upstream: str | None) -> str:
    """The queue in the Prometheus text format, then the running batch's own metrics."""
    lines = [
        "# HELP batchrun_serve_batches Batches by status.",
        "# TYPE batchrun_serve_batches gauge",
    ]
    lines += [f'batchrun_serve_batches{{status="{s}"}} {counts.get(s, 0)}' for s in STATUSES]
    queued = sum(counts.get(s, 0) for s in ("validating", "in_progress", "cancelling"))
    lines += [
        "# HELP batchrun_serve_queue_length Batches waiting for or in the worker.",
        "# TYPE batchrun_serve_queue_length gauge",
        f"batchrun_serve_queue_length {queued}",
        "# HELP batchrun_serve_running 1 while a batch runs.",
        "# TYPE batchrun_serve_running gauge",
        f"batchrun_serve_running {int(running is not None)}",
    ]
    text = "\n".join(lines) + "\n"
    return text + upstream if upstream else text
