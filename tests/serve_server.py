"""`batchrun serve` in a subprocess for the serve tests: start, wait until it answers, kill it
(SIGKILL to its process group: the server and its engine process) or stop it (SIGTERM)."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EMBEDDED = "SmolLM2-135M-Instruct"
KEY = "test-key-0123456789abcdef"
FINAL = ("completed", "failed", "expired", "cancelled")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batch_lines(num_rows: int, max_tokens: int = 8, model: str = EMBEDDED, start: int = 0):
    return [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": f"Name a colour and the number {i}."}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        }
        for i in range(start, start + num_rows)
    ]


def jsonl(lines: list) -> io.BytesIO:
    text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    return io.BytesIO(text.encode())


class Server:
    def __init__(self, data_dir: Path, *args: str, device: bool = True):
        # device: the engine options of a local executor (CPU, a small KV pool)
        self.data_dir = data_dir
        self.args = (*args, "--device", "cpu", "--kv-budget", "4096") if device else args
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = data_dir.parent / f"{data_dir.name}-serve.log"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 120.0) -> Server:
        # one thread: the tiny runs gain nothing from more on the shared CI cores
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, "-m", "batchrun.cli", "serve", "--data-dir", str(self.data_dir),
                "--port", str(self.port), *self.args]  # fmt: skip
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited ({self.proc.returncode}):\n{self.log()}")
            try:
                urllib.request.urlopen(self.base_url + "/files", timeout=5)
                return self
            except urllib.error.HTTPError:
                return self  # it answers (401 without a key)
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"the server did not answer in {timeout} s:\n{self.log()}")

    def client(self, key: str = KEY):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=60)

    def kill(self) -> None:
        """SIGKILL the server and its engine process (its process group)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM (drain and commit); the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the server did not stop in {timeout} s:\n{self.log()}") from None

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


def wait_batch(client, batch_id: str, until, timeout: float = 300.0, server=None):
    """Poll until `until(batch)` holds; the batch."""
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        if batch.status in FINAL or time.monotonic() > deadline:
            log = server.log() if server is not None else ""
            raise AssertionError(f"batch {batch_id}: {batch}\n{log}")
        time.sleep(0.2)


def output_lines(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def committed_rows(data_dir: Path, batch_id: str) -> int:
    try:
        m = json.loads((data_dir / "runs" / batch_id / "manifest.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return 0
    return m.get("ledger_rows", 0)
