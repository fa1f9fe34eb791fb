"""scripts/probe_decode_layer.py patches the decode kernels' source: every anchor it edits must
still occur once, and the patched modules must load (their jit functions parse)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from probe_decode_layer import KERNELS, load_patched, patched_source  # noqa: E402


@pytest.mark.parametrize("kind", sorted(KERNELS))
def test_the_probes_still_fit_the_kernels(kind, tmp_path):
    src = patched_source(kind)
    assert src.count("_probe(Probe, _pid,") >= 4
    module = load_patched(kind, tmp_path)
    assert module.PROBE == [None]
