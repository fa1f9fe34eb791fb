"""Python run inside a batchrun checkout (`python -m batchrun`, `python -c`, a script beside it)
puts the checkout on `sys.path`, and its top-level `kernels/` folder (installed as
`batchrun.kernels`) then shadows the `kernels` distribution that transformers (>= 5.25) imports.
`import batchrun` drops that one path, before anything imports transformers."""

from __future__ import annotations

import sys
from pathlib import Path


def drop_checkout_from_path() -> None:
    root = Path(__file__).resolve().parents[1]
    if not (root / "kernels" / "__init__.py").is_file():
        return  # an installed batchrun: its kernels are batchrun/kernels
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and 'name = "batchrun"' in pyproject.read_text():
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root]
