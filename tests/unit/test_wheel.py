"""The package built from the repository holds everything it runs: a wheel built with
`pip wheel --no-deps .` contains every package, every Triton kernel source of the top-level
kernels/ folder (as batchrun.kernels) and the live page, and once installed (not editable) into
a fresh virtual environment, `import batchrun.kernels.decode_attention` works from there."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs the git checkout"
)


def _source_copy(dest: Path) -> Path:
    """The checkout's files (tracked and untracked, .gitignore honoured) copied to dest: the
    build then starts from no build/ folder of an earlier one."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = _source_copy(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(src)],
        check=True, capture_output=True,
    )  # fmt: skip
    (path,) = out.glob("batchrun-*.whl")
    return path


def test_wheel_holds_every_package_and_kernel_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = sorted(p.name for p in (REPO / "kernels").glob("*.py"))
    assert "decode_attention.py" in kernels and "gemv.py" in kernels
    for name in kernels:
        assert f"batchrun/kernels/{name}" in names, name
    for init in (REPO / "batchrun").rglob("__init__.py"):
        assert f"batchrun/{init.relative_to(REPO / 'batchrun')}" in names, init
    for module in (REPO / "batchrun").rglob("*.py"):
        assert f"batchrun/{module.relative_to(REPO / 'batchrun')}" in names, module
    assert "batchrun/progress/index.html" in names
    # every package on disk is listed in pyproject.toml (an unlisted one would not ship)
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    on_disk = {
        ".".join(("batchrun", *p.parent.relative_to(REPO / "batchrun").parts))
        for p in (REPO / "batchrun").rglob("__init__.py")
    }
    assert on_disk | {"batchrun.kernels"} == listed


def test_installed_wheel_imports_the_kernels(wheel, tmp_path):
    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    # torch, triton and the other dependencies from this interpreter's site-packages, as a path
    # entry (.pth files there, the editable batchrun's among them, are not processed)
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
         "--target", str(site), str(wheel)],
        check=True, capture_output=True,
    )  # fmt: skip
    code = (
        "import batchrun, batchrun.kernels.decode_attention as d, batchrun.kernels.gemv;"
        "import batchrun.engine.engine, batchrun.cli;"
        "print(batchrun.__file__); print(d.__file__)"
    )
    out = subprocess.run(
        [python, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.split()
    assert all(Path(f).is_relative_to(site) for f in out), out
