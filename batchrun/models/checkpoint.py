"""A safetensors checkpoint, plain or sharded: its files, and any tensor by name whatever file it
sits in (what a quantized linear needs: its weight and scales may sit in different shards)."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from batchrun.errors import WeightLoadError
from batchrun.models.spec import TensorNames


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise WeightLoadError(
                f"{index} lists {missing[0].name}, which is missing from {model_dir} "
                f"({len(missing)} of {len(files)} shards missing); download the complete model"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(
            f"no *.safetensors in {model_dir}: batchrun loads Hugging Face safetensors "
            "checkpoints (or a .gguf file, or --load-format dummy for random weights)"
        )
    return files


class Checkpoint:
    """The open safetensors files of `model_dir` (a context manager: closes them on exit).

    for path, f in ckpt.files: ...     # each file and its handle, in order
    ckpt.get(name)                     # a tensor from whichever file holds it

    `name` is the text model's (`names.text_name`, the architecture's spec's: a multimodal
    checkpoint's `language_model.model.layers.0...` is `model.layers.0...`; its vision tower
    has none).
    """

    def __init__(self, model_dir: Path, names: TensorNames | None = None):
        self.model_dir = model_dir
        self.names = names or TensorNames()
        self._stack = ExitStack()
        self.files: list[tuple[Path, object]] = []
        # the text model's tensor name -> its file's handle and its name in the file
        self._where: dict[str, tuple[object, str]] = {}

    def __enter__(self) -> Checkpoint:
        try:
            for path in safetensors_files(self.model_dir):
                handle = self._open(path)
                self.files.append((path, handle))
                for stored in handle.keys():
                    name = self.names.text_name(stored)
                    if name is not None:
                        self._where[name] = (handle, stored)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _open(self, path: Path):
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:  # SafetensorError: truncated file, git-lfs pointer, ...
            raise WeightLoadError(
                f"{path}: not a readable safetensors file ({e}); a git-lfs pointer or an "
                "interrupted download? fetch the file again"
            ) from None
        return self._stack.enter_context(handle)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        handle, stored = self._where[name]
        return handle.get_tensor(stored)
