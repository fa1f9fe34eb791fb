"""`--serve-progress`: a live view of a running `submit` over HTTP (aiohttp, own thread and loop).

    runner (engine loop thread)             server thread (asyncio)
    ---------------------------             ---------------------------------------------
    hub.update(summary)    -- lock, copy -> tick every 0.5 s: hub.drain() -> one Snapshot
    hub.update_engine(c)   -- lock, keep     (snapshot.py: rates over a sliding window),
    hub.add_rows(lines)    -- lock, append   encoded once -> every client's slots ->
    hub.add_error(...)     -- lock, append   handlers write; after finish: last snapshot,
    hub.finish(status)                       `event: end`

Endpoints: ``GET /events`` (SSE: ``event: snapshot`` every 0.5 s; with ``?rows=1`` also
``event: rows``, one ``data:`` line per record as written to the results / errors files; a
final ``event: end`` when the run completes, is interrupted or fails), ``GET /`` (the live page,
served with the latest snapshot and the chart so far in it, so it shows the run at once and a
screenshot or a scraper needs no script to run first) and ``GET /metrics`` (Prometheus text
format). A non-loopback bind needs a token, checked on every
request (``Authorization: Bearer TOKEN`` or ``?token=TOKEN``).

Back-pressure policy: the runner never waits on the server. The hub keeps one counts tuple and,
only while a ``?rows=1`` client is connected, at most ``max_rows`` encoded rows between ticks
(past that the rows are dropped and every rows client is disconnected: its stream would have a
gap). Per client: the snapshot slot holds only the latest snapshot (drop-oldest: a slow client
skips snapshots), the rows queue holds at most ``CLIENT_QUEUE`` events (one per tick) and a
client that lets it overflow is disconnected, as is one whose write blocks for ``WRITE_TIMEOUT``
seconds. A stuck client therefore costs one idle connection, never engine or writer time.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import threading
from collections import deque
from importlib import resources

import msgspec
from aiohttp import web

from batchrun.progress.hub import ProgressHub
from batchrun.progress.metrics import metrics_text
from batchrun.progress.snapshot import ChartHistory, Snapshot, SnapshotMaker

__all__ = ["ProgressHub", "ProgressServer", "Snapshot", "is_loopback", "metrics_text", "parse_bind"]

TICK_S = 0.5
CLIENT_QUEUE = 256  # rows events (one per tick) a client may lag behind before it is dropped
WRITE_TIMEOUT = 10.0  # seconds one write to a client may block before it is dropped
END_EVENT = b"event: end\ndata: {}\n\n"
PAGE_SLOT = b"/*INITIAL*/null"  # index.html's placeholder for the state it starts from


_encoder = msgspec.json.Encoder()


def parse_bind(value: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` (loopback) or ``[::1]:PORT``; raises ValueError."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT or :PORT, got {value!r}")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere


class _Client:
    def __init__(self, rows: bool):
        self.rows = rows
        self.snapshot: bytes | None = None  # latest only (drop-oldest)
        self.queue: deque[bytes] = deque()  # rows events, at most CLIENT_QUEUE
        self.ended = False
        self.wake = asyncio.Event()
        self.task = asyncio.current_task()

    def offer(self, snapshot: bytes, rows: bytes | None, ended: bool) -> bool:
        """False: the rows queue overflowed (the caller disconnects this client)."""
        self.snapshot = snapshot
        if rows is not None and self.rows:
            if len(self.queue) >= CLIENT_QUEUE:
                return False
            self.queue.append(rows)
        self.ended = ended
        self.wake.set()
        return True


class ProgressServer:
    """The HTTP server in a daemon thread with its own event loop. ``start()`` binds (raises
    OSError on a busy port); ``stop()`` sends the end event to the clients and shuts down."""

    def __init__(self, hub: ProgressHub, host: str, port: int, token: str | None = None):
        if not is_loopback(host) and not token:
            raise ValueError(
                f"--serve-progress {host}:{port} is not a loopback address: anyone who can reach "
                "it could read the run; give --progress-token TOKEN (or bind 127.0.0.1)"
            )
        self.hub, self.host, self.port, self.token = hub, host, port, token
        self._clients: set[_Client] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._done: asyncio.Future | None = None
        self._runner: web.AppRunner | None = None
        self._maker = SnapshotMaker()
        self._history = ChartHistory()
        self._snapshot = Snapshot(status="starting")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def start(self) -> ProgressServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """After hub.finish(): let the clients get the last events, then shut down."""
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._stop(timeout), self._loop).result(timeout + 5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    async def _start(self) -> None:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/", self._page)
        app.router.add_get("/events", self._events)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, shutdown_timeout=0.5)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the real port when 0 was asked for
        self._done = asyncio.ensure_future(self._tick_loop())

    async def _stop(self, timeout: float) -> None:
        if not self.hub.is_finished:
            self.hub.finish("stopped")
        try:
            if self._done is not None:
                await asyncio.wait_for(asyncio.shield(self._done), timeout)
            handlers = [c.task for c in self._clients if c.task is not None]
            if handlers:
                await asyncio.wait(handlers, timeout=timeout)
        except asyncio.TimeoutError:
            pass
        if self._runner is not None:
            await self._runner.cleanup()

    # -- broadcasting --------------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        while True:
            ended = self._tick()
            if ended:
                return
            await asyncio.sleep(TICK_S)  # NOTE: the snapshot period, not a synchronization

    def _tick(self) -> bool:
        state = self.hub.drain()
        self._snapshot = snap = self._maker.make(state, len(self._clients))
        self._history.add(snap)
        data = b"event: snapshot\ndata: " + _encoder.encode(snap) + b"\n\n"
        rows_event = None
        if state.rows:
            rows_event = b"event: rows\n" + b"".join(
                b"data: " + r.rstrip(b"\n") + b"\n" for r in state.rows
            )
            rows_event += b"\n"
        ended = state.status not in ("starting", "running")  # this snapshot is the last
        for client in list(self._clients):
            if (state.rows_lost and client.rows) or not client.offer(data, rows_event, ended):
                self._drop(client)
        return ended

    def _drop(self, client: _Client) -> None:
        self._clients.discard(client)
        self.hub.want_rows = any(c.rows for c in self._clients)
        if client.task is not None:
            client.task.cancel()

    # -- handlers ------------------------------------------------------------------------------

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.token:
            given = request.query.get("token", "")
            header = request.headers.get("Authorization", "")
            if header.startswith("Bearer "):
                given = header[len("Bearer ") :]
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                raise web.HTTPUnauthorized(
                    text="a token is required: Authorization: Bearer TOKEN or ?token=TOKEN\n",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        return await handler(request)

    async def _page(self, request: web.Request) -> web.Response:
        page = resources.files("batchrun.progress").joinpath("index.html").read_bytes()
        initial = _encoder.encode({"snapshot": self._snapshot, "points": self._history.points})
        # NOTE: inside a <script>, where an error message holding "</script>" or "<!--" would
        # end or change it: every "<" (only ever inside a JSON string) is escaped
        page = page.replace(PAGE_SLOT, initial.replace(b"<", b"\\u003c"), 1)
        return web.Response(body=page, content_type="text/html", charset="utf-8")

    async def _events(self, request: web.Request) -> web.StreamResponse:
        client = _Client(rows=request.query.get("rows", "0") not in ("", "0", "false"))
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        self._clients.add(client)
        self.hub.want_rows = self.hub.want_rows or client.rows
        snap = b"event: snapshot\ndata: " + _encoder.encode(self._snapshot) + b"\n\n"
        client.offer(snap, None, self.hub.is_finished and self._done.done())
        try:
            while True:
                await client.wake.wait()
                client.wake.clear()
                chunks = list(client.queue)
                client.queue.clear()
                if client.snapshot is not None:
                    chunks.append(client.snapshot)
                    client.snapshot = None
                if client.ended:
                    chunks.append(END_EVENT)
                await asyncio.wait_for(resp.write(b"".join(chunks)), WRITE_TIMEOUT)
                if client.ended:
                    break
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            if client in self._clients:
                self._clients.discard(client)
                self.hub.want_rows = any(c.rows for c in self._clients)
        return resp

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=metrics_text(self._snapshot), content_type="text/plain")
