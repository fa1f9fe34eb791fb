"""`batchrun serve` killed and stopped mid-batch, and under load (CPU, the embedded model).

- SIGKILL (server and engine process) right after the batch is created and again after rows
  are committed; each time started again on the same data directory: the same files and
  batches, the batch completes with every custom_id exactly once and the texts of a clean run
  (the same file as a second batch, never interrupted).
- SIGTERM mid-batch: the server drains, commits and exits 0; started again, the batch ends
  exactly once.
- Load: 50 clients polling and 20 uploading at once (to 127.0.0.1, for a bounded time): every
  response is right, and the batch running meanwhile completes.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serve_server import (  # noqa: E402
    Server,
    batch_lines,
    committed_rows,
    jsonl,
    output_lines,
    wait_batch,
)

pytestmark = pytest.mark.slow
ENDPOINT = "/v1/chat/completions"


def _wait_committed(server: Server, batch_id: str, rows: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while committed_rows(server.data_dir, batch_id) < rows:
        assert time.monotonic() < deadline, server.log()
        assert server.proc.poll() is None, server.log()
        time.sleep(0.02)


def _texts(client, batch) -> dict[str, str]:
    lines = output_lines(client, batch.output_file_id)
    ids = [r["custom_id"] for r in lines]
    assert len(ids) == len(set(ids)), "a custom_id is in the output twice"
    return {
        r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in lines
    }


def test_sigkill_mid_batch_then_restart(tmp_path):
    server = Server(tmp_path / "data", "--commit-every", "1", "--max-running", "2").start()
    client = server.client()
    rows = batch_lines(12, max_tokens=16)
    upload = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h"
    )
    time.sleep(0.3)
    server.kill()  # validating, or loading the model
    server.start()
    _wait_committed(server, batch.id, 3)
    server.kill()  # mid-run, rows committed
    assert committed_rows(server.data_dir, batch.id) < len(rows)
    server.start()
    client = server.client()
    assert client.files.retrieve(upload.id).bytes == upload.bytes
    assert batch.id in [b.id for b in client.batches.list()]
    done = wait_batch(client, batch.id, lambda b: b.status == "completed", server=server)
    assert done.request_counts.completed == len(rows) and done.error_file_id is None

    clean = client.batches.create(
        input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h"
    )
    clean = wait_batch(client, clean.id, lambda b: b.status == "completed", server=server)
    texts = _texts(client, done)
    assert sorted(texts) == sorted(r["custom_id"] for r in rows)
    assert texts == _texts(client, clean)
    assert server.stop() == 0, server.log()


def test_sigterm_drains_and_the_restart_finishes(tmp_path):
    server = Server(tmp_path / "data", "--commit-every", "1", "--max-running", "2").start()
    client = server.client()
    rows = batch_lines(12, max_tokens=16)
    upload = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h"
    )
    _wait_committed(server, batch.id, 2)
    assert server.stop() == 0, server.log()
    manifest = json.loads((server.data_dir / "runs" / batch.id / "manifest.json").read_text())
    assert manifest["status"] == "interrupted"
    server.start()
    client = server.client()
    done = wait_batch(client, batch.id, lambda b: b.status == "completed", server=server)
    assert sorted(_texts(client, done)) == sorted(r["custom_id"] for r in rows)
    assert server.stop() == 0, server.log()


def test_load_pollers_and_uploaders(tmp_path):
    server = Server(tmp_path / "data", "--max-running", "4").start()
    client = server.client()
    upload = client.files.create(
        file=("in.jsonl", jsonl(batch_lines(8, max_tokens=8))), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h"
    )
    until = time.monotonic() + 15.0  # bounded: 15 s of traffic, then the threads end
    problems: list[str] = []
    counts = {"polls": 0, "uploads": 0}
    lock = threading.Lock()

    def poll() -> None:
        c = server.client()
        while time.monotonic() < until and not problems:
            b = c.batches.retrieve(batch.id)
            if b.id != batch.id or b.input_file_id != upload.id or b.request_counts is None:
                problems.append(f"poll: {b}")
            with lock:
                counts["polls"] += 1

    def upload_files(k: int) -> None:
        c = server.client()
        i = 0
        while time.monotonic() < until and not problems:
            body = jsonl(batch_lines(2, start=1000 * k + i)).getvalue()
            f = c.files.create(file=(f"u{k}-{i}.jsonl", body), purpose="batch")
            if f.bytes != len(body) or c.files.content(f.id).content != body:
                problems.append(f"upload {k}-{i}: {f}")
            with lock:
                counts["uploads"] += 1
            i += 1

    threads = [threading.Thread(target=poll) for _ in range(50)]
    threads += [threading.Thread(target=upload_files, args=(k,)) for k in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not problems, problems[:3]
    assert counts["polls"] >= 50 and counts["uploads"] >= 20
    done = wait_batch(client, batch.id, lambda b: b.status == "completed", server=server)
    assert done.request_counts.completed == 8
    assert server.stop() == 0, server.log()
