"""What `submit` and `plan` say about a model before anything runs: a config.json transformers
rejects (exit 4, no traceback), a --max-model-len above the model's context (exit 2), a model
named ORG/NAME from the local hub cache (--revision), and plan's KV bytes for --dtype /
--device."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_tiny_chat_model  # noqa: E402

from batchrun.cli import main  # noqa: E402

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tinychat")
    make_tiny_chat_model(path)
    return path


@pytest.fixture
def dataset(tmp_path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "Hello"}\n{"prompt": "Count to three"}\n')
    return path


def edited(model: Path, root: Path, **changes) -> Path:
    out = root / "edited"
    shutil.copytree(model, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(changes)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def run(*args: str, env: dict | None = None):
    return CliRunner().invoke(main, list(args), env=env)


@pytest.mark.parametrize("mode", [[], ["--in-process"]])
def test_config_transformers_rejects_is_exit_4(model, dataset, tmp_path, mode):
    bad = edited(model, tmp_path, num_hidden_layers=3.0)
    out = tmp_path / "out"
    r = run("submit", str(dataset), "--model", str(bad), "--out", str(out), "--device", "cpu",
            "--max-tokens", "2", *mode)  # fmt: skip
    assert r.exit_code == 4, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert "num_hidden_layers" in r.output and "Traceback" not in r.output
    assert not out.exists()  # a failed start leaves no --out behind
    r = run("plan", str(dataset), "--model", str(bad))
    assert r.exit_code == 4 and "num_hidden_layers" in r.output, r.output


def test_unsupported_architecture_is_refused_before_the_tokenizer(model, dataset, tmp_path):
    falcon = edited(
        model, tmp_path, architectures=["FalconForCausalLM"], model_type="falcon", head_dim=16
    )
    for cmd in (["submit", "--out", str(tmp_path / "o"), "--device", "cpu"], ["plan"]):
        r = run(cmd[0], str(dataset), "--model", str(falcon), *cmd[1:])
        assert r.exit_code == 4, r.output
        assert "unsupported architecture" in r.output


def test_max_model_len_above_the_context_is_a_bad_option(model, dataset, tmp_path):
    out = tmp_path / "out"
    r = run("submit", str(dataset), "--model", str(model), "--out", str(out), "--device", "cpu",
            "--max-model-len", "100000")  # fmt: skip
    assert r.exit_code == 2, r.output
    assert "--max-model-len" in r.output and "1024" in r.output
    assert not out.exists()
    r = run("plan", str(dataset), "--model", str(model), "--max-model-len", "100000")
    assert r.exit_code == 2 and "1024" in r.output, r.output


def make_hub_cache(model: Path, root: Path) -> Path:
    """models--org--tiny with refs/main -> COMMIT and a tag v1 -> the same snapshot."""
    repo = root / "hub" / "models--org--tiny"
    shutil.copytree(model, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v1").write_text(COMMIT)
    return root / "hub"


def test_hub_name_from_the_local_cache(model, dataset, tmp_path, monkeypatch):
    hub = make_hub_cache(model, tmp_path)
    monkeypatch.chdir(tmp_path)
    env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    r = run("plan", str(dataset), "--model", "org/tiny", env=env)
    assert r.exit_code == 0, r.output
    assert COMMIT in r.output
    for revision in ("v1", COMMIT):
        r = run("plan", str(dataset), "--model", "org/tiny", "--revision", revision, env=env)
        assert r.exit_code == 0, r.output
    out = tmp_path / "out"
    r = run("submit", str(dataset), "--model", "org/tiny", "--out", str(out), "--device", "cpu",
            "--max-tokens", "2", "--in-process", env=env)  # fmt: skip
    assert r.exit_code == 0, r.output
    assert COMMIT in json.loads((out / "manifest.json").read_text())["model"]

    r = run("plan", str(dataset), "--model", "org/tiny", "--revision", "v2", env=env)
    assert r.exit_code == 4 and "'v2'" in r.output and "main, v1" in r.output, r.output
    r = run("plan", str(dataset), "--model", "org/other", env=env)
    assert r.exit_code == 4, r.output
    assert str(hub / "models--org--other") in r.output and "never downloads" in r.output
    r = run("plan", str(dataset), "--model", str(model), "--revision", "v1", env=env)
    assert r.exit_code == 2 and "--revision" in r.output, r.output


def test_hub_cache_from_hf_home(model, tmp_path, monkeypatch):
    from batchrun.models.embedded import resolve_model_path

    hub = make_hub_cache(model, tmp_path)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(hub.parent))
    (hub.parent / "hub").exists() or hub.rename(hub.parent / "hub")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("org/tiny") == tmp_path / "hub/models--org--tiny/snapshots" / COMMIT


@pytest.mark.parametrize(
    ("args", "per_token"),
    [
        (["--device", "cpu"], 2 * 3 * 2 * 16 * 4),  # float32: --dtype auto on the CPU
        (["--device", "cpu", "--dtype", "bfloat16"], 2 * 3 * 2 * 16 * 2),
        (["--dtype", "float32", "--kv-cache-dtype", "fp8_e4m3"], 2 * 3 * 2 * 16),
    ],
)
def test_plan_kv_bytes_follow_dtype_and_device(model, dataset, args, per_token):
    r = run("plan", str(dataset), "--model", str(model), *args)
    assert r.exit_code == 0, r.output
    assert f"({per_token:,} bytes a token" in r.output


@pytest.mark.parametrize("mode", [[], ["--in-process"]])
def test_a_failed_start_leaves_no_out_directory(model, dataset, tmp_path, mode):
    """The weights do not match config.json: the engine fails at start, after --out was made
    (and its parent); both go again, as nothing was committed. An --out that existed stays."""
    bad = edited(model, tmp_path, hidden_size=128)
    out = tmp_path / "runs" / "exp"
    r = run("submit", str(dataset), "--model", str(bad), "--out", str(out), "--device", "cpu",
            *mode)  # fmt: skip
    assert r.exit_code == 4 and "expected (260, 128)" in r.output, r.output
    assert not (tmp_path / "runs").exists()
    out.mkdir(parents=True)
    r = run("submit", str(dataset), "--model", str(bad), "--out", str(out), "--device", "cpu",
            *mode)  # fmt: skip
    assert r.exit_code == 4 and out.is_dir()
