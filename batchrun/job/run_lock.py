"""A run directory's lock: held (fcntl) by the process that runs into it, from the moment it
opens the directory until the run ends; the kernel drops it when that process dies, however it
dies. `batchrun inspect` tells a live run (lock held) from an interrupted one (manifest status
"running", lock free: killed, or stopped before its final commit), and the lock file names the
command that resumes it. A second process that finds the lock held is refused: two writers
would interleave their commits in one directory.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import socket
import sys
from pathlib import Path
from typing import IO, NamedTuple

from batchrun.errors import RunError

LOCK_NAME = ".batchrun.lock"


class LockInfo(NamedTuple):
    """What the lock file says about the process that last took it."""

    pid: int | None
    host: str | None
    cwd: str | None
    command: str | None


class RunLock:
    def __init__(self, file: IO[str]):
        self._file: IO[str] | None = file

    @classmethod
    def acquire(cls, out: Path) -> RunLock:
        """Take `out`'s lock; RunError when a live process holds it. The file is not written
        (a complete run run again touches nothing): `record` writes this process into it."""
        if Path(out).exists() and not Path(out).is_dir():
            raise RunError(f"--out {out} exists and is not a directory")
        try:
            Path(out).mkdir(parents=True, exist_ok=True)
            file = open(Path(out) / LOCK_NAME, "a+", encoding="utf-8")  # noqa: SIM115 (held)
        except OSError as e:
            raise RunError(f"cannot prepare --out {out}: {e}") from e
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.close()
            info = read_lock(out)
            who = f"process {info.pid} on {info.host}" if info.pid else "another process"
            raise RunError(
                f"{out} is in use: {who} is running into it ({info.command or 'command unknown'})"
                "; wait for it to end, or give another --out"
            ) from None
        return cls(file)

    def record(self) -> None:
        """Write this process (pid, host, directory, command) into the held lock file."""
        file = self._file
        if file is None:
            return
        file.seek(0)
        file.truncate()
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "cwd": os.getcwd(),
            "command": command_line(sys.argv),
        }
        file.write(json.dumps(record) + "\n")
        file.flush()

    def release(self) -> None:
        """Drop the lock (idempotent); the file stays, naming the last command."""
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def is_locked(out: Path) -> bool:
    """Whether a live process holds `out`'s lock (one without a lock file: no)."""
    try:
        file = open(Path(out) / LOCK_NAME, encoding="utf-8")  # noqa: SIM115
    except OSError:
        return False
    with file:
        try:
            fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(file, fcntl.LOCK_UN)
        return False


def read_lock(out: Path) -> LockInfo:
    try:
        data = json.loads((Path(out) / LOCK_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return LockInfo(None, None, None, None)
    if not isinstance(data, dict):
        return LockInfo(None, None, None, None)
    return LockInfo(data.get("pid"), data.get("host"), data.get("cwd"), data.get("command"))


def command_line(argv: list[str]) -> str:
    """The command this process runs, as a user would type it again."""
    if not argv:
        return "(unknown)"
    head = Path(argv[0])
    if head.name == "batchrun":
        return shlex.join(["batchrun", *argv[1:]])
    if head.name == "__main__.py" and head.parent.name in ("batchrun", "cli"):
        return shlex.join(["python", "-m", "batchrun", *argv[1:]])
    return shlex.join(["python", *argv])
