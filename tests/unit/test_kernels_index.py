"""kernels/__init__.py's index names every kernel module of the folder, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def test_the_index_lists_every_kernel_module():
    doc = (KERNELS / "__init__.py").read_text().split('"""')[1]
    listed = set(re.findall(r"^    ([a-z0-9_]+) {2,}", doc, flags=re.M))
    modules = {p.stem for p in KERNELS.glob("*.py") if p.stem != "__init__"}
    assert listed == modules
