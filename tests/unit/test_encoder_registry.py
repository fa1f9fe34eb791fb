"""The encoders of the architecture registry (models/registry.py ENCODERS): one spec an
architecture in its own file, registered under its name, and no other library module that names
one; each builds its blocks from config.json."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

pytest.importorskip("torch")

import batchrun  # noqa: E402
import batchrun.models  # noqa: E402
from batchrun.errors import ModelConfigError  # noqa: E402
from batchrun.models.registry import ARCHITECTURES, ENCODERS  # noqa: E402

LIBRARY = Path(batchrun.__file__).parent
RAW = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, max_position_embeddings=64)  # fmt: skip


def _spec_files() -> dict[str, Path]:
    files = {}
    for info in pkgutil.iter_modules(batchrun.models.__path__):
        module = importlib.import_module(f"batchrun.models.{info.name}")
        for value in vars(module).values():
            for name, spec in ENCODERS.items():
                if value is spec:
                    files[name] = Path(module.__file__)
    return files


def test_each_encoder_spec_is_registered_under_its_own_name():
    assert all(spec.name == name for name, spec in ENCODERS.items())
    assert set(_spec_files()) == set(ENCODERS)
    assert not set(ENCODERS) & set(ARCHITECTURES)  # generate never builds an encoder
    assert {spec.head for spec in ENCODERS.values()} == {"base", "classify"}


def test_no_library_module_but_its_own_and_the_registry_names_an_encoder():
    files = _spec_files()
    registry = LIBRARY / "models" / "registry.py"
    for path in sorted(LIBRARY.rglob("*.py")):
        text = path.read_text()
        named = [n for n in ENCODERS if re.search(rf"(?<![A-Za-z]){n}(?![A-Za-z])", text)]
        strays = [n for n in named if path not in (registry, files[n])]
        assert not strays, f"{path.relative_to(LIBRARY)} names {strays}"


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_each_spec_builds_its_blocks_and_refuses_what_they_lack(name):
    spec = ENCODERS[name]
    labels = 2 if spec.head == "classify" else 0
    net = spec.build({**RAW, "architectures": [name]}, labels, "config.json")
    assert net.config.max_tokens > 0
    assert any("classifier" in n for n, _ in net.named_parameters()) == bool(labels)
    bad = {**RAW, "hidden_act": "swish", "hidden_activation": "swish"}
    with pytest.raises(ModelConfigError, match="not supported"):
        spec.build(bad, labels, "config.json")
