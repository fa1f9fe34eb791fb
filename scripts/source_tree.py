"""Which source a benchmark ran: `git_commit()` for the figures' header and JSON.

A clean checkout is its commit ("7d14be3"). A tree with changes is "HEAD+dirty (tree T)", where
T is the tree hash git would give the working tree (tracked and untracked files, .gitignore
honoured) if it were committed. The GPU machine runs a copy of the working tree whose .git may
be older than the code, so its HEAD alone says little; T matches the local commit of the same
files: `git log --format='%h %T' | grep T`.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str, env: dict | None = None, root: Path = ROOT) -> str:
    return subprocess.check_output(
        ["git", *args], cwd=root, text=True, stderr=subprocess.DEVNULL, env=env
    ).strip()


def worktree_tree(root: Path = ROOT) -> str:
    """The tree hash of the working tree as `git add -A && git write-tree` would give it, built
    in a scratch index (the repository's own index is not touched)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GIT_INDEX_FILE=str(Path(tmp) / "index"))
        _git("add", "-A", env=env, root=root)
        return _git("write-tree", env=env, root=root)


def git_commit(root: Path = ROOT) -> str:
    """ "HEAD", "HEAD+dirty (tree T)", "HEAD+dirty" where the tree cannot be hashed (a read-only
    .git), or BATCHRUN_COMMIT / "unknown" outside a git checkout."""
    try:
        head = _git("rev-parse", "--short", "HEAD", root=root)
        if not _git("status", "--porcelain", root=root):
            return head
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("BATCHRUN_COMMIT", "unknown")
    try:
        return f"{head}+dirty (tree {worktree_tree(root)[:10]})"
    except (OSError, subprocess.CalledProcessError):
        return f"{head}+dirty"
