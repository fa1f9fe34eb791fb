"""The architecture registry (batchrun/models/registry.py): one spec an architecture, in the
architecture's own file, and no other library module that names an architecture."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import batchrun  # noqa: E402
import batchrun.models  # noqa: E402
from batchrun.models.config import ModelConfig, ModelConfigError  # noqa: E402
from batchrun.models.registry import ARCHITECTURES, MODEL_TYPES  # noqa: E402
from batchrun.models.spec import no_experts  # noqa: E402

LIBRARY = Path(batchrun.__file__).parent


def _spec_files() -> dict[str, Path]:
    """Architecture name -> the file of the module that holds its spec."""
    files = {}
    for info in pkgutil.iter_modules(batchrun.models.__path__):
        module = importlib.import_module(f"batchrun.models.{info.name}")
        for value in vars(module).values():
            for name, spec in ARCHITECTURES.items():
                if value is spec:
                    files[name] = Path(module.__file__)
    return files


def test_each_spec_is_registered_under_its_own_name():
    assert all(spec.name == name for name, spec in ARCHITECTURES.items())
    assert len(MODEL_TYPES) == len(ARCHITECTURES)  # one model_type an architecture
    assert set(_spec_files()) == set(ARCHITECTURES)


def test_no_library_module_but_its_own_and_the_registry_names_an_architecture():
    files = _spec_files()
    registry = LIBRARY / "models" / "registry.py"
    for path in sorted(LIBRARY.rglob("*.py")):
        text = path.read_text()
        named = [name for name in ARCHITECTURES if name in text]
        strays = [name for name in named if path not in (registry, files[name])]
        assert not strays, f"{path.relative_to(LIBRARY)} names {strays}"


def test_a_model_type_without_architectures_reads_as_its_architecture():
    raw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4)  # fmt: skip
    dense = [t for t, name in MODEL_TYPES.items() if ARCHITECTURES[name].moe is no_experts]
    assert len(dense) >= 5
    for model_type in dense:  # the ones whose config these fields complete
        if ARCHITECTURES[MODEL_TYPES[model_type]].prepare is None:
            cfg = ModelConfig.from_dict({**raw, "model_type": model_type})
            assert cfg.architecture == MODEL_TYPES[model_type]
    with pytest.raises(ModelConfigError, match="unsupported architecture.*Mistral"):
        ModelConfig.from_dict({**raw, "model_type": "gpt2"})
