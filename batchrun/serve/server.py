"""`batchrun serve`: the store, the worker and the HTTP API together, until SIGTERM / SIGINT.

A stop signal closes the listener, lets the running batch drain and commit (it stays
in_progress and continues at the next start), then exits 0.
"""

from __future__ import annotations

import sys

from aiohttp import web

from batchrun.progress.server import is_loopback
from batchrun.serve.app import Api
from batchrun.serve.auth import Keys
from batchrun.serve.config import Layout, ServeConfig
from batchrun.serve.executor import Executor
from batchrun.serve.store import Store


class ServeError(Exception):
    """A setting that cannot serve (the message says which); nothing was started."""


def make_backend(config: ServeConfig, layout: Layout, store: Store):
    if config.executor == "slurm":
        from batchrun.serve.slurm import SlurmBackend

        return SlurmBackend(config, layout, store)
    from batchrun.serve.local import LocalBackend

    return LocalBackend(config, layout)


def serve(config: ServeConfig, say=print) -> None:
    keys = Keys.from_file(config.api_key_file)
    if keys is None and not is_loopback(config.host):
        raise ServeError(
            f"--host {config.host} is not a loopback address and there is no --api-key-file: "
            "anyone who can reach it could read every batch; give --api-key-file FILE"
        )
    layout = Layout(config.data_dir).make()
    for part in layout.tmp.iterdir():  # uploads and outputs that a kill left half written
        part.unlink()
    store = Store(layout.db)
    executor = Executor(config, store, layout, make_backend(config, layout, store))
    api = Api(config, store, layout, keys, executor)
    app = api.app()

    async def start_worker(app: web.Application) -> None:
        executor.start()

    async def stop_worker(app: web.Application) -> None:
        say("batchrun serve: stopping; the running batch drains and commits", file=sys.stderr)
        executor.stop()  # NOTE: blocks the loop while the batch drains: no request is served

    app.on_startup.append(start_worker)
    app.on_shutdown.append(stop_worker)
    where = f"http://{config.host}:{config.port}/v1"
    models = ", ".join(f"{n} ({p or 'embedded'})" for n, p in config.models)
    if config.executor == "slurm":
        say(f"batchrun serve: models {models}; each batch a Slurm array job", file=sys.stderr)
    else:
        say(f"batchrun serve: models {models}; {config.dp} engine(s) (--dp)", file=sys.stderr)
    if keys is None:
        say(f"batchrun serve: {where} (no --api-key-file: loopback only, no keys)", file=sys.stderr)
    else:
        say(f"batchrun serve: {where} (API keys from {config.api_key_file})", file=sys.stderr)
    try:
        web.run_app(
            app, host=config.host, port=config.port, print=None, access_log=None,
            shutdown_timeout=5.0,
        )  # fmt: skip
    finally:
        store.close()
