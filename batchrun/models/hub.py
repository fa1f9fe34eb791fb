"""A model named as on the Hugging Face hub (``ORG/NAME``), found in the local hub cache, and the
tokenizer of a model directory, loaded through transformers with its errors named.

The hub cache is where `huggingface-cli download` (and every transformers `from_pretrained`)
puts a model; batchrun reads it and never downloads:

    $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub
      models--ORG--NAME/
        refs/main                   the commit hash the branch (or tag) points at
        snapshots/<commit>/         config.json, *.safetensors, tokenizer files (links to blobs/)
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from batchrun.errors import ModelConfigError

# a hub repository id: NAME or ORG/NAME (letters, digits, "-", "_", ".")
REPO_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")


def hub_cache_dir() -> Path:
    """The local hub cache, from the environment as the Hugging Face libraries read it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def is_repo_id(model: str) -> bool:
    """Whether `model` reads as a hub name (ORG/NAME) rather than a path."""
    return bool(REPO_ID.match(model)) and not model.startswith((".", "~")) and ".." not in model


def resolve_hub_model(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot directory of `repo_id` at `revision` (a branch or tag name through refs/, or
    a commit hash; default main) in the local hub cache. ModelConfigError naming where it
    looked when it is not there."""
    from huggingface_hub import try_to_load_from_cache  # local: only for hub names

    cache = hub_cache_dir()
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    found = try_to_load_from_cache(
        repo_id, "config.json", cache_dir=cache, revision=revision or "main"
    )
    if isinstance(found, str):
        return Path(found).parent
    if not repo_dir.is_dir():
        raise ModelConfigError(
            f"model {repo_id!r} is not a directory or a .gguf file, and not in the local Hugging "
            f"Face hub cache (no {repo_dir}; the cache is $HF_HUB_CACHE, else $HF_HOME/hub, else "
            f"~/.cache/huggingface/hub). batchrun never downloads: fetch it first with "
            f"`huggingface-cli download {repo_id}`, or give the model's directory"
        )
    have = sorted(p.name for p in (repo_dir / "refs").glob("*")) + sorted(
        p.name for p in (repo_dir / "snapshots").glob("*")
    )
    raise ModelConfigError(
        f"model {repo_id!r} at revision {revision or 'main'!r}: no snapshot with a config.json "
        f"in {repo_dir} (refs and snapshots there: {', '.join(have) or 'none'}); give one of "
        f"them with --revision, or fetch it with `huggingface-cli download {repo_id}"
        + (f" --revision {revision}`" if revision else "`")
    )


def load_tokenizer(model_dir: Path) -> Any:
    """The tokenizer of `model_dir`; ModelConfigError (a ValueError) when transformers cannot
    load it or the config.json it reads on the way (a field of the wrong type, a field its
    config class rejects), so every caller reports it as a model that cannot be loaded."""
    from transformers import AutoTokenizer  # local: seconds to import, only when a model loads

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # transformers and huggingface_hub raise many types here
        raise ModelConfigError(
            "transformers cannot load it (its config.json, which transformers' config class "
            f"checks field by field, or its tokenizer files): {type(e).__name__}: {_one_line(e)}"
        ) from e


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())
