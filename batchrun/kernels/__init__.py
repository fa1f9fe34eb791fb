"""GPU kernels, importable as `batchrun.kernels.<module>`.

The Triton sources live in the repository's top-level `kernels/` folder (the design card's
layout). There is deliberately no top-level `kernels` package: a PyPI package of that name
exists and transformers probes for it, so we extend this package's search path instead.
"""

from __future__ import annotations

from pathlib import Path

_SOURCE_DIR = Path(__file__).resolve().parents[2] / "kernels"
if _SOURCE_DIR.is_dir():
    __path__.append(str(_SOURCE_DIR))  # noqa: F821  (module attribute of a package)
