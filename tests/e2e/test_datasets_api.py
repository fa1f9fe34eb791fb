"""`generate_dataset` on the tiny chat model: a `datasets.Dataset` in, the same rows with
completions out, equal to the plain Engine API; and the jobs/ example script end to end."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from tiny_models import make_tiny_chat_model  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.job.datasets_api import generate_dataset  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

PROMPTS = ["Hello there", "What is two plus two?", "Name a color.", "Count to three", "Hi"]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    path = tmp_path_factory.mktemp("tinychat")
    make_tiny_chat_model(path)
    return Engine(EngineConfig(model=str(path), device="cpu", kv_budget=2048))


def test_completions_in_row_order_match_engine(engine):
    ds = datasets.Dataset.from_dict({"id": [f"r{i}" for i in range(5)], "prompt": PROMPTS})
    out = generate_dataset(ds, engine=engine, sampling=GREEDY)
    assert isinstance(out, datasets.Dataset)
    assert out.column_names == [
        "id",
        "prompt",
        "completion",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
    ]
    assert out["id"] == ds["id"]
    tok = engine.tokenizer
    for row in out:
        text = tok.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        ids = tok(text, add_special_tokens=False)["input_ids"]
        (want,) = list(engine.generate([GenerateRequest("x", ids, GREEDY)]))
        assert row["completion"] == tok.decode(want.output_ids, skip_special_tokens=True)
        assert row["finish_reason"] == want.finish_reason
        assert row["prompt_tokens"] == len(ids)
        assert 1 <= row["completion_tokens"] <= 8


def test_messages_system_prompt_and_bad_rows(engine):
    msgs = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]]
    out = generate_dataset(
        datasets.Dataset.from_dict({"m": msgs}),
        messages_column="m",
        engine=engine,
        sampling=GREEDY,
    )
    assert out[0]["finish_reason"] in ("stop", "length") and out[0]["prompt_tokens"] > 10

    with_sys = generate_dataset(
        datasets.Dataset.from_dict({"prompt": ["Hi"]}),
        engine=engine,
        sampling=GREEDY,
        system_prompt="Be brief.",
    )
    assert with_sys[0]["prompt_tokens"] == out[0]["prompt_tokens"]

    # one row longer than the context (1024 tokens) fails alone
    ds = datasets.Dataset.from_dict({"prompt": ["ok", "x" * 3000, "fine"]})
    out = generate_dataset(ds, engine=engine, sampling=GREEDY)
    assert out["finish_reason"][1] == "error" and out["completion"][1] is None
    assert out["finish_reason"][0] != "error" and out["finish_reason"][2] != "error"

    # a row with an image part (a multimodal model's row) fails alone: the text model runs
    parts = [
        [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        [{"role": "user", "content": [{"type": "image", "url": "a.png"}]}],
    ]
    out = generate_dataset(
        datasets.Dataset.from_dict({"m": parts}), messages_column="m", engine=engine,
        sampling=GREEDY,
    )  # fmt: skip
    assert out["finish_reason"][1] == "error" and out["completion"][1] is None
    assert out["finish_reason"][0] != "error"

    with pytest.raises(ValueError, match="no column"):
        generate_dataset(ds, prompt_column="question", engine=engine)
    with pytest.raises(ValueError, match="n=1"):
        generate_dataset(ds, engine=engine, sampling=SamplingParams(n=2))


def test_pipeline_example_script(engine, tmp_path, monkeypatch):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"prompt": "{p}"}}\n' for p in PROMPTS))
    out = tmp_path / "out"
    argv = [
        "hf_datasets_pipeline.py",
        str(src),
        "--out",
        str(out),
        "--parquet",
        str(tmp_path / "out.parquet"),
        "--model",
        str(engine.model_dir),
        "--device",
        "cpu",
        "--max-tokens",
        "6",
        "--kv-budget",
        "2048",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "jobs" / "hf_datasets_pipeline.py"), run_name="__main__")
    assert exit_info.value.code == 0
    back = datasets.load_from_disk(str(out))
    assert back["prompt"] == PROMPTS and all(c is not None for c in back["completion"])
    assert datasets.Dataset.from_parquet(str(tmp_path / "out.parquet")).num_rows == 5


def test_mixed_prompt_and_messages_rows(engine):
    """examples/prompts.jsonl mixes prompt rows and messages rows: a datasets table gives every
    row both columns, one of them null; each row runs with the one it has, as in submit."""
    ds = datasets.load_dataset(
        "json", data_files=str(ROOT / "examples" / "prompts.jsonl"), split="train"
    )
    assert None in ds["prompt"] and None in ds["messages"]
    out = generate_dataset(ds, engine=engine, sampling=GREEDY)
    assert "error" not in out["finish_reason"]
    chat = next(r for r in out if r["prompt"] is None)
    (plain,) = generate_dataset(
        datasets.Dataset.from_dict({"m": [chat["messages"]]}),
        prompt_column=None,
        messages_column="m",
        engine=engine,
        sampling=GREEDY,
    )
    assert plain["completion"] == chat["completion"]


def test_a_row_that_cannot_run_fails_alone(engine):
    """No prompt at all, both set, or a conversation the chat template rejects: an error row."""
    user = {"role": "user", "content": "Hi"}
    ds = datasets.Dataset.from_list(
        [
            {"prompt": "ok", "messages": None},
            {"prompt": None, "messages": None},
            {"prompt": "both", "messages": [user]},
            {"prompt": None, "messages": [user]},
        ]
    )
    out = generate_dataset(ds, engine=engine, sampling=GREEDY)
    assert out["finish_reason"][1] == out["finish_reason"][2] == "error"
    assert out["finish_reason"][0] != "error" and out["finish_reason"][3] != "error"
    assert out["completion"][1] is None


def test_pipeline_script_on_the_example_file(engine, tmp_path, monkeypatch):
    out = tmp_path / "out"
    argv = ["hf_datasets_pipeline.py", str(ROOT / "examples" / "prompts.jsonl"), "--out", str(out)]
    argv += ["--model", str(engine.model_dir), "--device", "cpu", "--max-tokens", "4"]
    monkeypatch.setattr(sys, "argv", argv + ["--kv-budget", "4096"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "jobs" / "hf_datasets_pipeline.py"), run_name="__main__")
    assert exit_info.value.code == 0
    back = datasets.load_from_disk(str(out))
    assert all(c is not None for c in back["completion"])


def test_cuda_error_names_the_api_argument(engine):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    ds = datasets.Dataset.from_dict({"prompt": ["Hi"]})
    with pytest.raises(ValueError, match="device='cpu'") as e:
        generate_dataset(ds, model=str(engine.model_dir), device="cuda")
    assert "--device" not in str(e.value)
