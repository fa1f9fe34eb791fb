"""The local backend: a batch runs on this box's engine through the job's own Runner (resume,
shards, progress), with the live progress of the running batch served on loopback for app.py to
pass on (its page and SSE stream, its metrics)."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import replace

from batchrun.engine_process.client import EngineProcessError
from batchrun.errors import RunError
from batchrun.job.config import RunConfig
from batchrun.job.runner import Runner
from batchrun.params import SamplingParams
from batchrun.progress.hub import ProgressHub
from batchrun.progress.server import ProgressServer
from batchrun.serve.config import Layout, ServeConfig
from batchrun.serve.engines import EnginePool
from batchrun.serve.executor import BatchFailed


def run_config(config: ServeConfig, layout: Layout, batch: dict) -> RunConfig:
    """The `submit` run of a batch: its input file, its run directory, its model."""
    return RunConfig(
        dataset=str(layout.file_path(batch["input_file_id"])),
        out=str(layout.run_dir(batch["id"])),
        engine=replace(config.engine, model=config.model_path(batch["model"])),
        defaults=SamplingParams(),
        quiet=True,
        commit_every=config.commit_every,
        commit_interval=config.commit_interval,
        drain_timeout=config.drain_timeout,
        handle_signals=False,  # the server's worker thread: app.py handles the signals
        engine_process=config.engine_process,
        notify_batch=config.notify_batch,
        dp=config.dp,
        served_model_name=batch["model"],
    )


class LocalBackend:
    def __init__(self, config: ServeConfig, layout: Layout):
        self.config, self.layout = config, layout
        self.engines = EnginePool(config)
        self.runner: Runner | None = None
        self.progress: ProgressServer | None = None  # the running batch's, on loopback
        self.progress_token = secrets.token_urlsafe(24)

    def run(self, batch: dict, stop_reason: Callable[[], str | None]) -> bool:
        """True when every row is done; False when stopped (cancel, expiry, shutdown)."""
        try:
            engine = self.engines.get(batch["model"])
        except (RunError, ValueError, OSError) as e:
            raise BatchFailed(f"the model {batch['model']!r} cannot be loaded: {e}") from e
        hub = ProgressHub()
        progress = ProgressServer(hub, "127.0.0.1", 0, self.progress_token).start()
        try:
            try:
                runner = Runner(run_config(self.config, self.layout, batch), engine, hub)
            except RunError as e:
                raise BatchFailed(str(e)) from e
            self.runner, self.progress = runner, progress
            reason = stop_reason()  # NOTE: after self.runner is set: stop() sees one of the two
            if reason is not None:
                runner.request_stop(reason)
            try:
                summary = runner.run()
            except EngineProcessError as e:
                self.engines.close()
                raise BatchFailed(f"the engine failed: {e}") from e
            except RunError as e:
                raise BatchFailed(str(e)) from e
            if engine.has_work:  # a drain that timed out: the engine still holds rows
                self.engines.close()
            return not summary.interrupted
        finally:
            self.runner, self.progress = None, None
            progress.stop()

    def stop(self) -> None:
        runner = self.runner
        if runner is not None:
            runner.request_stop("stop")

    def live_counts(self) -> dict | None:
        runner = self.runner
        if runner is None:
            return None
        s = runner.summary
        return {"completed": s.rows_ok, "failed": s.rows_failed}

    def progress_url(self) -> str | None:
        progress = self.progress
        return None if progress is None else progress.url

    def close(self) -> None:
        self.engines.close()
