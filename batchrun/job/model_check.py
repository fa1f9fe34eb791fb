"""The model a run names, checked from its config.json before anything is started."""

from __future__ import annotations

from batchrun.config import EngineConfig
from batchrun.errors import ModelConfigError, ModelError, OptionError
from batchrun.models.config import ModelConfig
from batchrun.models.context import served_context_len
from batchrun.models.embedded import resolve_model_path


def check_model(engine: EngineConfig) -> None:
    """What the model's config.json says, checked once the input is (before --out is made, the
    tokenizer or the weights load): an architecture or config batchrun cannot run (ModelError,
    exit 4), a context_len (--max-model-len) above the model's context (OptionError, exit 2)."""
    try:
        cfg = ModelConfig.from_dir(resolve_model_path(engine.model))
    except (ValueError, OSError) as e:
        raise ModelError(f"cannot load the model: {e}") from e
    try:
        served_context_len(engine.context_len, cfg)
    except ModelConfigError as e:
        raise OptionError(str(e)) from e
