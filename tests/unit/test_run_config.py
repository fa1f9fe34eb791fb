"""RunConfig: the served model name and its default."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchrun.job.config import RunConfig, default_served_model_name


@pytest.mark.parametrize(
    "model, name",
    [
        (None, "SmolLM2-135M-Instruct"),
        ("/models/Llama-3.1-8B-Instruct", "Llama-3.1-8B-Instruct"),
        ("/models/Llama-3.1-8B-Instruct/", "Llama-3.1-8B-Instruct"),
        ("/models/qwen/../Qwen2.5-7B", "Qwen2.5-7B"),
        ("/gguf/tinyllama.Q4_0.gguf", "tinyllama.Q4_0"),
        (
            "/hf/hub/models--meta-llama--Llama-3.1-8B-Instruct/snapshots/0e9e39f249a16976918f6564",
            "meta-llama/Llama-3.1-8B-Instruct",
        ),
    ],
)
def test_default_served_model_name(model, name) -> None:
    assert default_served_model_name(model) == name


def test_served_model_name_of_a_run(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = RunConfig("in.jsonl", "out")
    assert cfg.model_name == "SmolLM2-135M-Instruct"
    from batchrun.config import EngineConfig

    assert RunConfig("in.jsonl", "out", EngineConfig(model=".")).model_name == tmp_path.name
    assert RunConfig("in.jsonl", "out", served_model_name="x").model_name == "x"
    with pytest.raises(ValueError, match="served_model_name"):
        RunConfig("in.jsonl", "out", served_model_name=" ")
    assert Path(".").resolve() == tmp_path
