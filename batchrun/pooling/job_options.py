"""What `batchrun submit --task embed|rerank|score|classify` asks of a run: PoolingJobOptions
(frozen; part of the resume fingerprint), the task a model folder runs by default, and the
checks that refuse a bad combination before the model loads."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from batchrun.pooling.layout import POOLING_MODES

# NOTE: names only (this module is imported by the CLI before torch and pyarrow load); the engine
# (pooling/engine.py TASKS) and the vector shards (vector_shard.py EMBEDDING_DTYPES) check the same
TASKS = ("embed", "rerank", "score", "classify")
EMBEDDING_DTYPES = ("float32", "float16")


@dataclass(frozen=True)
class PoolingJobOptions:
    task: str
    pooling: str | None = None  # None: the model folder's
    normalize: bool | None = None  # None: the folder's Normalize module says
    dimensions: int | None = None
    query_prefix: str | None = None  # before every embed text / rerank and score query
    raw_scores: bool = False
    truncate: bool = True  # False: a row longer than max_seq_length is a row error
    embedding_dtype: str = "float32"
    tokenizer_workers: int | None = None  # None: job_rows.default_tokenizer_workers's rule

    def __post_init__(self) -> None:
        """ValueError naming what is supported for a combination that means nothing."""
        if self.task not in TASKS:
            raise ValueError(f"--task {self.task!r}; supported here: {', '.join(TASKS)}")
        embed_only = {
            "--pooling": self.pooling is not None,
            "--no-normalize": self.normalize is False,
            "--dimensions": self.dimensions is not None,
            "--embedding-dtype": self.embedding_dtype != "float32",
        }
        given = [k for k, v in embed_only.items() if v]
        if self.task != "embed" and given:
            raise ValueError(f"{', '.join(given)} apply to --task embed only (not {self.task})")
        if self.raw_scores and self.task not in ("rerank", "score"):
            raise ValueError("--raw-scores applies to --task rerank and --task score only")
        if self.pooling is not None and self.pooling not in POOLING_MODES:
            raise ValueError(f"--pooling {self.pooling!r}; supported: {', '.join(POOLING_MODES)}")
        if self.embedding_dtype not in EMBEDDING_DTYPES:
            raise ValueError(
                f"--embedding-dtype {self.embedding_dtype!r}; supported: "
                f"{', '.join(EMBEDDING_DTYPES)}"
            )
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"--dimensions must be >= 1; got {self.dimensions}")
        if self.tokenizer_workers is not None and self.tokenizer_workers < 0:
            raise ValueError(f"--tokenizer-workers must be >= 0; got {self.tokenizer_workers}")

    def fingerprint(self) -> dict:
        """What a resume must match: the options that change a row's output (not how many
        processes tokenize)."""
        fields = asdict(self)
        del fields["tokenizer_workers"]
        return fields


def default_task(model_dir: str | Path | None) -> str:
    """The task a model runs without --task: embed for an encoder, a `...Model` or a
    sentence-transformers folder, classify for a `...ForSequenceClassification`, else generate."""
    if model_dir is None:
        return "generate"
    path = Path(model_dir).expanduser()
    config = path / "config.json"
    if not path.is_dir() or not config.is_file():
        return "generate"
    if (path / "modules.json").is_file():
        return "embed"
    try:
        arch = (json.loads(config.read_text()).get("architectures") or [""])[0]
    except (OSError, ValueError):
        return "generate"
    if arch.endswith("ForSequenceClassification"):
        return "classify"
    if arch.endswith("Model"):
        return "embed"
    return "generate"
