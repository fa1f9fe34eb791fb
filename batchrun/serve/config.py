"""What `batchrun serve` is asked to do (ServeConfig, frozen) and where its data lives (Layout)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from batchrun.config import EngineConfig
from batchrun.engine_process.notify import DEFAULT_NOTIFY_BATCH
from batchrun.io.rows import OPENAI_URLS
from batchrun.job.config import EMBEDDED_SERVED_NAME

ENDPOINTS = OPENAI_URLS  # what the OpenAI Batch reader runs (batchrun/io/rows.py)
COMPLETION_WINDOWS = {"24h": 24 * 3600}  # OpenAI's one window
EXECUTORS = ("local", "slurm")
DEFAULT_MAX_FILE_BYTES = 200 * 1000 * 1000
# ids are made here and checked against these before any path is built from one
FILE_ID = re.compile(r"file-[0-9a-f]{24}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")


def parse_models(values: tuple[str, ...]) -> tuple[tuple[str, str | None], ...]:
    """``NAME=PATH`` each (None: the embedded model under its own name); raises ValueError."""
    if not values:
        return ((EMBEDDED_SERVED_NAME, None),)
    models: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--model {value!r}: expected NAME=PATH (the name the rows give)")
        if name in models:
            raise ValueError(f"--model: the name {name!r} is given twice")
        path = os.path.expanduser(path.strip())
        # NOTE: absolute when it exists (Slurm tasks run elsewhere); else a hub name, as given
        models[name.strip()] = os.path.abspath(path) if os.path.exists(path) else path
    return tuple(models.items())


@dataclass(frozen=True)
class SlurmOptions:
    script: str  # the array job script (jobs/batchrun-array.sbatch)
    tasks: int = 1  # array tasks per batch (each a shard)
    sbatch_args: tuple[str, ...] = ()
    submit_args: tuple[str, ...] = ()  # options of `batchrun submit` for every task
    batchrun: str = "batchrun"  # the command the tasks run
    poll_s: float = 2.0


@dataclass(frozen=True)
class ServeConfig:
    data_dir: Path
    models: tuple[tuple[str, str | None], ...] = ((EMBEDDED_SERVED_NAME, None),)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key_file: str | None = None
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    engine: EngineConfig = field(default_factory=EngineConfig)  # model: set per batch
    engine_process: bool = True
    dp: int = 1
    notify_batch: int = DEFAULT_NOTIFY_BATCH
    commit_every: int = 1000
    commit_interval: float = 30.0
    drain_timeout: float = 30.0
    executor: str = "local"
    slurm: SlurmOptions | None = None

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}")
        if self.executor == "slurm" and self.slurm is None:
            raise ValueError("the slurm executor needs its SlurmOptions")
        if self.max_file_bytes < 1:
            raise ValueError("max_file_bytes must be >= 1")

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.models)

    def model_path(self, name: str) -> str | None:
        return dict(self.models)[name]


@dataclass(frozen=True)
class Layout:
    """state.db, files/<file id>.jsonl, runs/<batch id>/ (a batchrun run directory), tmp/."""

    root: Path

    def make(self) -> Layout:
        for d in (self.root, self.files, self.runs, self.tmp):
            d.mkdir(parents=True, exist_ok=True)
        return self

    @property
    def db(self) -> Path:
        return self.root / "state.db"

    @property
    def files(self) -> Path:
        return self.root / "files"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    def file_path(self, file_id: str) -> Path:
        if not FILE_ID.fullmatch(file_id):
            raise ValueError(f"not a file id: {file_id!r}")
        return self.files / f"{file_id}.jsonl"

    def run_dir(self, batch_id: str) -> Path:
        if not BATCH_ID.fullmatch(batch_id):
            raise ValueError(f"not a batch id: {batch_id!r}")
        return self.runs / batch_id
