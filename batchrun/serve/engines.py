"""The engine the local executor runs batches on: kept loaded while the next batch uses the same
model, replaced when a batch needs another one (data parallel over the box's GPUs with --dp)."""

from __future__ import annotations

from dataclasses import replace

from batchrun.engine.engine import Engine
from batchrun.engine_process.client import EngineProcess
from batchrun.engine_process.data_parallel import DataParallelEngine, device_indices
from batchrun.engine_process.tp_launcher import start_tp_engine
from batchrun.serve.config import ServeConfig


class EnginePool:
    def __init__(self, config: ServeConfig):
        self.config = config
        self.model: str | None = None
        self.engine = None

    def get(self, model: str):
        """The engine for `model`, loading it (and closing another model's) when needed."""
        if self.engine is not None and self.model == model:
            return self.engine
        self.close()
        cfg = self.config
        engine_config = replace(cfg.engine, model=cfg.model_path(model))
        if not cfg.engine_process:
            if engine_config.tp_size > 1:
                self.engine = start_tp_engine(engine_config, engine_config.tp_size)
            else:
                self.engine = Engine(engine_config)
        else:
            indices = device_indices(engine_config, cfg.dp)
            if cfg.dp > 1:
                self.engine = DataParallelEngine(
                    engine_config, cfg.dp, notify_batch=cfg.notify_batch, device_indices=indices
                )
            else:
                self.engine = EngineProcess(
                    engine_config, notify_batch=cfg.notify_batch, device_index=indices[0]
                )
        self.model = model
        return self.engine

    def close(self) -> None:
        """Close the loaded engine (a batch that left work in it, or another model is next)."""
        engine, self.engine, self.model = self.engine, None, None
        close = getattr(engine, "close", None)
        if close is not None:
            close()
