"""`python -m batchrun` run inside a checkout puts the checkout on `sys.path`, and its top-level
`kernels/` folder (installed as `batchrun.kernels`) then shadows the `kernels` distribution that
transformers (>= 5.25) imports. The entry points drop that one path before importing anything."""

from __future__ import annotations

import sys
from pathlib import Path


def drop_checkout_from_path() -> None:
    root = Path(__file__).resolve().parents[1]
    if (root / "kernels" / "__init__.py").is_file() and (root / "pyproject.toml").is_file():
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root]
