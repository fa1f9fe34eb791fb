"""Gemma 3 on the engine (fp32, CPU, the torch attention), past its sliding window: the radix
cache and chunked prefill change no greedy token; Gemma3ForConditionalGeneration checkpoints
load under either naming of their text model (the hub's `language_model.model.*`, which
transformers 5 also saves, and transformers 5's module names `model.language_model.*`), the
vision tower skipped with a log line. Parity with transformers: test_parity_tiny.py; --tp 2:
test_tensor_parallel.py."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import GEMMA3_WINDOW, make_tiny_model, random_prompts  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

NEW = 24


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gemma3")
    make_tiny_model("gemma3", path)
    return str(path)


def workload() -> list[GenerateRequest]:
    """Groups sharing a 30-token prefix (radix hits past the window) and unrelated prompts."""
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(6, seed=11, min_len=20, max_len=70)
    prompts += [prompts[0][:30] + p[:12] for p in prompts[1:5]]
    assert all(len(p) > GEMMA3_WINDOW for p in prompts)
    return [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]


def run(model_dir: str, **overrides) -> tuple[dict[str, list[int]], Engine]:
    cfg = dict(model=model_dir, device="cpu", dtype="float32", kv_budget=8192)
    engine = Engine(EngineConfig(**{**cfg, **overrides}))
    out = {}
    for res in engine.generate(workload()):
        assert res.finish_reason == "length", res
        out[res.rid] = res.output_ids
    engine.check_integrity()
    return out, engine


@pytest.fixture(scope="module")
def reference(gemma_dir) -> dict[str, list[int]]:
    out, engine = run(gemma_dir, enable_radix_cache=False, max_running=1, chunked_prefill_size=None)
    assert engine.stats.cached_tokens == 0
    return out


def test_radix_cache_on_gives_the_same_tokens_and_hits(gemma_dir, reference):
    out, engine = run(gemma_dir)
    assert out == reference
    assert engine.stats.cached_tokens >= 30


@pytest.mark.parametrize("chunk", [7, 16, 64])
def test_chunked_prefill_sizes_give_the_same_tokens(gemma_dir, reference, chunk):
    out, _ = run(gemma_dir, chunked_prefill_size=chunk)
    assert out == reference


def _rename(src: Path, dst: Path, rules: tuple[tuple[str, str], ...]) -> None:
    """A copy of the checkpoint at src with its tensors' name prefixes replaced."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    for f in src.glob("*.safetensors"):
        renamed = {}
        for name, tensor in load_file(f).items():
            for old, new in rules:
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            renamed[name] = tensor
        save_file(renamed, dst / f.name, metadata={"format": "pt"})


def test_conditional_generation_loads_under_both_namings(tmp_path, caplog):
    hf = make_tiny_model("gemma3-mm", tmp_path / "saved")
    raw = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert raw["architectures"] == ["Gemma3ForConditionalGeneration"] and "text_config" in raw
    keys = load_file(next((tmp_path / "saved").glob("*.safetensors"))).keys()
    assert any(k.startswith("language_model.model.layers.") for k in keys)  # the hub's names
    assert any(k.startswith("vision_tower.") for k in keys)
    _rename(
        tmp_path / "saved",
        tmp_path / "modules",
        (
            ("language_model.model.", "model.language_model."),
            ("vision_tower.", "model.vision_tower."),
            ("multi_modal_projector.", "model.multi_modal_projector."),
        ),
    )
    prompt = random_prompts(1, seed=3, min_len=40, max_len=40)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    for name in ("saved", "modules"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="batchrun.models.loader"):
            engine = Engine(EngineConfig(model=str(tmp_path / name), device="cpu", dtype="float32"))
        skipped = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
        assert len(skipped) == 1 and "skipped: batchrun runs the text model" in skipped[0], name
        logits = engine.score(prompt)
        assert float((logits - ref).norm() / ref.norm()) <= 1e-4, name


def test_conditional_generation_quantized_at_load(tmp_path):
    """--quantization fp8 reads the text model's linears under the hub's names too (FP8
    weights and activations: near transformers' logits, not equal)."""
    hf = make_tiny_model("gemma3-mm", tmp_path)
    engine = Engine(EngineConfig(model=str(tmp_path), device="cpu", quantization="fp8"))
    assert engine.model_config.quantization is not None
    prompt = random_prompts(1, seed=4, min_len=30, max_len=30)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    logits = engine.score(prompt).float()
    assert float((logits - ref).norm() / ref.norm()) <= 0.3
