"""The HTTP API (aiohttp, the progress server's stack): OpenAI's Files and Batches endpoints.

    POST /v1/files  GET /v1/files  GET|DELETE /v1/files/{id}  GET /v1/files/{id}/content
    POST /v1/batches  GET /v1/batches  GET /v1/batches/{id}  POST /v1/batches/{id}/cancel
    GET /v1/batches/{id}/progress/ (live page; events: SSE; metrics)   GET /metrics

Every request names its key (``Authorization: Bearer KEY``; the progress page may give
``?token=KEY``, which a browser's EventSource needs); a file or batch of another key is a 404.
Ids are checked against their pattern before any path is built from one, so no request path
reaches outside the data directory. An upload streams to a temporary file and is refused with
413 as soon as it passes --max-file-bytes.
"""

from __future__ import annotations

import os
import uuid

import aiohttp
from aiohttp import web

from batchrun.serve.auth import LOCAL_OWNER, Keys, bearer
from batchrun.serve.config import (
    BATCH_ID,
    COMPLETION_WINDOWS,
    ENDPOINTS,
    FILE_ID,
    Layout,
    ServeConfig,
)
from batchrun.serve.objects import error, file_object, new_batch, page
from batchrun.serve.progress import metrics_text, proxy_progress
from batchrun.serve.store import Store, new_id

CHUNK = 1 << 16
MULTIPART_SLACK = 1 << 16  # a multipart body's bytes beyond the file's (boundaries, purpose)
CREATE_FIELDS = ("input_file_id", "endpoint", "completion_window", "metadata")


class Api:
    def __init__(self, config: ServeConfig, store: Store, layout: Layout, keys, executor):
        self.config, self.store, self.layout = config, store, layout
        self.keys: Keys | None = keys
        self.executor = executor
        self.session: aiohttp.ClientSession | None = None  # to the running batch's progress

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        r = app.router
        r.add_post("/v1/files", self.upload)
        r.add_get("/v1/files", self.list_files)
        r.add_get("/v1/files/{id}", self.get_file)
        r.add_delete("/v1/files/{id}", self.delete_file)
        r.add_get("/v1/files/{id}/content", self.file_content)
        r.add_post("/v1/batches", self.create_batch)
        r.add_get("/v1/batches", self.list_batches)
        r.add_get("/v1/batches/{id}", self.get_batch)
        r.add_post("/v1/batches/{id}/cancel", self.cancel_batch)
        r.add_get("/v1/batches/{id}/progress", self.progress)
        r.add_get("/v1/batches/{id}/progress/{tail:(events|metrics)?}", self.progress)
        r.add_get("/metrics", self.metrics)
        app.on_startup.append(self._open_session)
        app.on_cleanup.append(self._close_session)
        return app

    async def _open_session(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def _close_session(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        given = bearer(request.headers.get("Authorization"))
        if given is None and "/progress" in request.path:
            given = request.query.get("token")
        if self.keys is None:
            request["owner"] = LOCAL_OWNER
        else:
            owner = self.keys.owner(given)
            if owner is None:
                what = "an API key is required" if not given else "the API key is not known"
                return error(401, f"{what}: Authorization: Bearer KEY", code="invalid_api_key")
            request["owner"] = owner
        return await handler(request)

    # -- files -------------------------------------------------------------------------------

    async def upload(self, request: web.Request) -> web.StreamResponse:
        limit = self.config.max_file_bytes
        too_big = error(413, f"the file is larger than this server's {limit:,} bytes")
        if (request.content_length or 0) > limit + MULTIPART_SLACK:
            too_big.force_close()
            return too_big
        if not request.content_type.startswith("multipart/"):
            return error(400, "upload the file as multipart/form-data (file, purpose=batch)")
        reader = await request.multipart()
        purpose = filename = tmp = None
        size = 0
        try:
            while (part := await reader.next()) is not None:
                if part.name == "purpose":
                    purpose = (await part.read_chunk(256)).decode(errors="replace").strip()
                elif part.name == "file" and tmp is None:
                    filename = part.filename or "upload.jsonl"
                    tmp = self.layout.tmp / f"upload-{uuid.uuid4().hex}"
                    size = await _save(part, tmp, limit)
                    if size > limit:
                        await _discard(request, MULTIPART_SLACK + CHUNK)
                        too_big.force_close()
                        return too_big
                else:
                    await part.release()
            if tmp is None:
                return error(400, "the request has no 'file' part", param="file")
            if purpose != "batch":
                return error(400, f"purpose {purpose!r} is not supported; use 'batch'", "purpose")
            file_id = new_id("file-")
            os.replace(tmp, self.layout.file_path(file_id))
            tmp = None
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        row = self.store.add_file(file_id, request["owner"], purpose, filename, size)
        return web.json_response(file_object(row))

    def _file(self, request: web.Request) -> dict | None:
        file_id = request.match_info["id"]
        if not FILE_ID.fullmatch(file_id):
            return None
        return self.store.get_file(file_id, request["owner"])

    async def get_file(self, request: web.Request) -> web.Response:
        row = self._file(request)
        if row is None:
            return error(404, f"no file {request.match_info['id']!r}")
        return web.json_response(file_object(row))

    async def list_files(self, request: web.Request) -> web.Response:
        limit = _limit(request, 10_000)
        if isinstance(limit, web.Response):
            return limit
        rows, more = self.store.list_files(
            request["owner"], request.query.get("purpose"), request.query.get("after"), limit
        )
        return web.json_response(page([file_object(r) for r in rows], more))

    async def file_content(self, request: web.Request) -> web.StreamResponse:
        row = self._file(request)
        if row is None:
            return error(404, f"no file {request.match_info['id']!r}")
        return web.FileResponse(
            self.layout.file_path(row["id"]), headers={"Content-Type": "application/jsonl"}
        )

    async def delete_file(self, request: web.Request) -> web.Response:
        row = self._file(request)
        if row is None or not self.store.delete_file(row["id"], request["owner"]):
            return error(404, f"no file {request.match_info['id']!r}")
        if row["id"] in self.store.unused_deleted_files():  # else: when its batch ends
            self.layout.file_path(row["id"]).unlink(missing_ok=True)
        return web.json_response({"id": row["id"], "object": "file", "deleted": True})

    # -- batches -----------------------------------------------------------------------------

    async def create_batch(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        unknown = sorted(set(body) - set(CREATE_FIELDS))
        if unknown:
            return error(
                400, f"{', '.join(unknown)}: not supported; supported: {', '.join(CREATE_FIELDS)}"
            )
        file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
        window, metadata = body.get("completion_window"), body.get("metadata")
        if endpoint not in ENDPOINTS:
            return error(
                400, f"endpoint {endpoint!r} is not supported; use one of {', '.join(ENDPOINTS)}",
                "endpoint",
            )  # fmt: skip
        if window not in COMPLETION_WINDOWS:
            return error(
                400, f"completion_window {window!r} is not supported; use "
                f"{', '.join(COMPLETION_WINDOWS)}", "completion_window",
            )  # fmt: skip
        if metadata is not None and not _valid_metadata(metadata):
            return error(400, "metadata: at most 16 string keys and values", "metadata")
        row = None
        if isinstance(file_id, str) and FILE_ID.fullmatch(file_id):
            row = self.store.get_file(file_id, request["owner"])
        if row is None or row["purpose"] != "batch":
            return error(404, f"no batch input file {file_id!r}", "input_file_id")
        batch = new_batch(file_id, endpoint, window, COMPLETION_WINDOWS[window], metadata)
        self.store.add_batch(batch, request["owner"])
        self.executor.wake()
        return web.json_response(batch)

    def _batch(self, request: web.Request) -> dict | None:
        batch_id = request.match_info["id"]
        if not BATCH_ID.fullmatch(batch_id):
            return None
        return self.store.get_batch(batch_id, request["owner"])

    def _with_live_counts(self, batch: dict) -> dict:
        live = self.executor.live_counts(batch["id"])
        if live is not None and batch["status"] in ("in_progress", "cancelling"):
            batch["request_counts"] = {**batch["request_counts"], **live}
        return batch

    async def get_batch(self, request: web.Request) -> web.Response:
        batch = self._batch(request)
        if batch is None:
            return error(404, f"no batch {request.match_info['id']!r}")
        return web.json_response(self._with_live_counts(batch))

    async def list_batches(self, request: web.Request) -> web.Response:
        limit = _limit(request, 100)
        if isinstance(limit, web.Response):
            return limit
        rows, more = self.store.list_batches(request["owner"], request.query.get("after"), limit)
        return web.json_response(page([self._with_live_counts(b) for b in rows], more))

    async def cancel_batch(self, request: web.Request) -> web.Response:
        batch_id = request.match_info["id"]
        if not BATCH_ID.fullmatch(batch_id):
            return error(404, f"no batch {batch_id!r}")
        batch, act = self.store.cancel_batch(batch_id, request["owner"])
        if batch is None:
            return error(404, f"no batch {batch_id!r}")
        if act:
            self.executor.request_stop(batch_id, "cancel")
            self.executor.wake()
        return web.json_response(self._with_live_counts(batch))

    # -- watching ----------------------------------------------------------------------------

    async def progress(self, request: web.Request) -> web.StreamResponse:
        batch = self._batch(request)
        if batch is None:
            return error(404, f"no batch {request.match_info['id']!r}")
        if "tail" not in request.match_info:  # the page's relative links need the slash
            raise web.HTTPFound(request.rel_url.with_path(request.path + "/"))
        url = None
        if self.executor.current == batch["id"]:
            url = self.executor.backend.progress_url()
        if url is None:
            return error(409, f"batch {batch['id']} is {batch['status']}, not running here")
        token = self.executor.backend.progress_token
        return await proxy_progress(self.session, request, url, token)

    async def metrics(self, request: web.Request) -> web.Response:
        upstream = None
        url = self.executor.backend.progress_url()
        if url is not None:
            token = self.executor.backend.progress_token
            try:
                async with self.session.get(
                    url + "metrics", headers={"Authorization": f"Bearer {token}"}
                ) as r:
                    upstream = await r.text()
            except aiohttp.ClientError:
                upstream = None
        text = metrics_text(self.store.count_batches(), self.executor.current, upstream)
        return web.Response(text=text, content_type="text/plain")


async def _save(part, path, limit: int) -> int:
    """Stream a part to `path`; stops (and returns a size over `limit`) once past the limit."""
    size = 0
    with open(path, "wb") as f:
        while chunk := await part.read_chunk(CHUNK):
            size += len(chunk)
            if size > limit:
                return size
            f.write(chunk)
    return size


async def _discard(request: web.Request, most: int) -> None:
    """Read (never keep) what is left of an over-size body, at most `most` bytes, so the client
    reads the 413 instead of a reset connection."""
    left = most
    while left > 0 and (chunk := await request.content.read(min(CHUNK, left))):
        left -= len(chunk)


def _limit(request: web.Request, most: int) -> int | web.Response:
    value = request.query.get("limit", "20")
    if not value.isdigit() or not 1 <= int(value) <= most:
        return error(400, f"limit must be an integer from 1 to {most}", "limit")
    return int(value)


def _valid_metadata(metadata) -> bool:
    return (
        isinstance(metadata, dict)
        and len(metadata) <= 16
        and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    )
