"""What a `batchrun submit` run is asked to do: RunConfig, built by the CLI or a caller."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from batchrun.config import EngineConfig
from batchrun.engine_process.notify import DEFAULT_NOTIFY_BATCH
from batchrun.io.rows import RowSpec
from batchrun.job.order import DEFAULT_WINDOW, ORDERS
from batchrun.params import SamplingParams
from batchrun.pooling.job_options import PoolingJobOptions

EMBEDDED_SERVED_NAME = "SmolLM2-135M-Instruct"


def default_served_model_name(model: str | None) -> str:
    """The name a server would give `model`: the directory's name (``org/name`` for a HF hub
    cache snapshot), a .gguf file's stem, the embedded model's name for None."""
    if model is None:
        return EMBEDDED_SERVED_NAME
    # NOTE: abspath, not resolve: a symlink's own name is the one the user chose
    path = Path(os.path.abspath(Path(model).expanduser()))
    if path.suffix.lower() == ".gguf":
        return path.stem
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/", 1)
    return path.name or str(path)


# SamplingParams field -> the `submit` option that sets it: messages name the option
SAMPLING_OPTIONS = {
    "max_new_tokens": "--max-tokens",
    "min_new_tokens": "--min-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "repetition_penalty": "--repetition-penalty",
    "frequency_penalty": "--frequency-penalty",
    "presence_penalty": "--presence-penalty",
    "stop": "--stop",
    "n": "--n",
    "top_logprobs": "--logprobs",
    "logprobs": "--logprobs",
    "ignore_eos": "--ignore-eos",
    "grammar": "--response-format / --json-schema / --regex / --choice / --ebnf",
    "max_thinking_tokens": "--max-thinking-tokens",
}


@dataclass(frozen=True)
class RunConfig:
    dataset: str
    out: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    defaults: SamplingParams = SamplingParams()
    spec: RowSpec = field(default_factory=RowSpec)
    split: str | None = None
    limit: int | None = None
    shard_size: int = 10_000
    with_token_ids: bool = False
    overwrite: bool = False
    quiet: bool = False
    read_batch_size: int = 256
    order: str = "prefix"  # prefix: DFS order over token ids per window; input: as read
    order_window: int = DEFAULT_WINDOW  # rows ordered together (held in memory at once)
    commit_every: int = 1000  # rows between commits
    commit_interval: float = 30.0  # seconds between commits (when rows are waiting)
    drain_timeout: float = 30.0  # after a stop signal, seconds to finish the rows in flight
    num_shards: int = 1
    shard_index: int = 0
    handle_signals: bool = True  # install SIGTERM/SIGINT/SIGUSR1 handlers (main thread only)
    keep_signal_handlers: bool = False  # the CLI: after the run, a signal exits with its code
    engine_process: bool = True  # the engine in its own process (False: in this one)
    notify_batch: int = DEFAULT_NOTIFY_BATCH  # engine process: completions per wake-up
    dp: int = 1  # data parallel: engine processes, one per GPU (or tensor-parallel group)
    # "model" of every OpenAI Batch output line; None: default_served_model_name(engine.model)
    served_model_name: str | None = None
    # batchrun/chat/parsers.py: what of the output is reasoning and which parts are tool calls
    reasoning_parser: str = "auto"
    tool_call_parser: str = "auto"
    pooling: PoolingJobOptions | None = None  # --task embed / rerank / score / classify

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}; got {self.order!r}")
        if self.order_window < 1:
            raise ValueError(f"order_window must be >= 1; got {self.order_window}")
        if self.commit_every < 1 or self.commit_interval < 0 or self.drain_timeout < 0:
            raise ValueError("commit_every must be >= 1, commit_interval and drain_timeout >= 0")
        if self.notify_batch < 1:
            raise ValueError(f"notify_batch must be >= 1; got {self.notify_batch}")
        if self.dp < 1:
            raise ValueError(f"dp must be >= 1; got {self.dp}")
        if self.dp > 1 and not self.engine_process:
            raise ValueError("data parallel (dp > 1) runs engine processes; drop --in-process")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be empty")
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard_index {self.shard_index} not in 0..{self.num_shards - 1}")

    @property
    def model_name(self) -> str:
        """The model's name in the output: served_model_name, else its default."""
        return self.served_model_name or default_served_model_name(self.engine.model)
