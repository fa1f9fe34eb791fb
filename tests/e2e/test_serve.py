"""`batchrun serve` end to end with the real `openai` client and the embedded SmolLM2 model (CPU):
the client's own calls (upload, create, poll, download), keys and limits, validation failures
with line numbers, cancel mid-run with the live progress and /metrics on the way."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai  # the test extra: the real client, as users run it
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serve_server import (  # noqa: E402
    EMBEDDED,
    KEY,
    Server,
    batch_lines,
    committed_rows,
    jsonl,
    output_lines,
    wait_batch,
)

OTHER_KEY = "other-key-fedcba9876543210"
REPO = Path(__file__).resolve().parents[2]
SNIPPET = [  # docs/serve.md's client -> what runs here: this server, short completions
    ('base_url="http://127.0.0.1:8000/v1", api_key="KEY"', 'base_url="{url}", api_key="{key}"'),
    ('"max_tokens": 32', '"max_tokens": 4'),
    ("time.sleep(5)", "time.sleep(0.5)"),
]


def client_snippet(path: Path) -> str | None:
    """The ```python block of `path` that creates a batch (None: there is none)."""
    for block in re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S):
        if "client.batches.create" in block:
            return block
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    keys = root / "keys.txt"
    keys.write_text(f"# two keys\n{KEY}\n\n{OTHER_KEY}\n")
    srv = Server(root / "data", "--api-key-file", str(keys), "--max-file-bytes", "20000",
                 "--commit-every", "1", "--max-running", "2").start()  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.log()


def _get(url: str, key: str | None = KEY) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_client_end_to_end(server):
    client = server.client()
    lines = batch_lines(4)
    bad = batch_lines(1, start=4)[0]
    bad["body"]["messages"] = []  # runs nowhere: this row alone goes to the error file
    upload = client.files.create(file=("in.jsonl", jsonl([*lines, bad])), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes > 0
    assert client.files.retrieve(upload.id).filename == "in.jsonl"
    batch = client.batches.create(
        input_file_id=upload.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "e2e"},
    )
    assert batch.status == "validating" and batch.metadata == {"job": "e2e"}
    done = wait_batch(client, batch.id, lambda b: b.status == "completed", server=server)
    assert done.request_counts.total == 5
    assert (done.request_counts.completed, done.request_counts.failed) == (4, 1)
    for stamp in ("created_at", "in_progress_at", "finalizing_at", "completed_at", "expires_at"):
        assert getattr(done, stamp), stamp
    assert done.model == EMBEDDED
    assert done.usage.output_tokens > 0 and done.usage.input_tokens > 0
    results = output_lines(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in results) == [f"req-{i}" for i in range(4)]
    for r in results:
        assert r["error"] is None and r["response"]["status_code"] == 200
        completion = openai.types.chat.ChatCompletion.model_validate(r["response"]["body"])
        assert completion.model == EMBEDDED and completion.choices[0].message.content
    errors = output_lines(client, done.error_file_id)
    assert [e["custom_id"] for e in errors] == ["req-4"] and errors[0]["error"]["message"]
    listed = client.batches.list(limit=100)
    assert batch.id in [b.id for b in listed.data]
    paged = [b.id for b in client.batches.list(limit=1)]  # the client follows `after`
    assert paged == [b.id for b in listed.data]
    assert client.batches.list(limit=1).has_more == (len(paged) > 1)
    files = [f.id for f in client.files.list()]
    assert {upload.id, done.output_file_id, done.error_file_id} <= set(files)
    deleted = client.files.delete(upload.id)
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)


def test_completions_endpoint(server):
    client = server.client()
    rows = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": EMBEDDED, "prompt": f"The number {i} is", "max_tokens": 4}}
        for i in range(2)
    ]  # fmt: skip
    upload = client.files.create(file=("c.jsonl", jsonl(rows)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    done = wait_batch(client, batch.id, lambda b: b.status == "completed", server=server)
    results = output_lines(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in results) == ["c0", "c1"]
    for r in results:
        completion = openai.types.Completion.model_validate(r["response"]["body"])
        assert completion.choices[0].text


def test_keys_limits_and_paths(server):
    mine, other = server.client(), server.client(OTHER_KEY)
    upload = mine.files.create(file=("a.jsonl", jsonl(batch_lines(2))), purpose="batch")
    batch = mine.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(upload.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(upload.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert upload.id not in [f.id for f in other.files.list()]
    assert batch.id not in [b.id for b in other.batches.list()]
    with pytest.raises(openai.AuthenticationError):
        server.client("not-a-key-of-this-server").files.list()
    assert _get(server.base_url + "/files", key=None)[0] == 401
    with pytest.raises(openai.APIStatusError) as too_big:
        mine.files.create(file=("big.jsonl", jsonl(batch_lines(200))), purpose="batch")
    assert too_big.value.status_code == 413
    assert not list((server.data_dir / "tmp").iterdir())  # nothing of it kept
    for path in ("/files/..%2Fstate.db/content", "/files/../../state.db", "/batches/..%2F..",
                 "/files/file-%2E%2E%2Fstate/content", "/batches/%2e%2e/progress/"):  # fmt: skip
        status, body = _get(server.base_url + path)
        assert status == 404 and b"SQLite" not in body, path
    with pytest.raises(openai.BadRequestError):
        mine.batches.create(
            input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError):
        mine.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="1h"
        )
    wait_batch(mine, batch.id, lambda b: b.status == "completed", server=server)


def test_validation_fails_with_line_numbers(server):
    client = server.client()
    lines = batch_lines(5)
    lines[1] = "{not json"
    lines[3]["custom_id"] = "req-0"  # a duplicate of line 1's
    lines[4]["body"]["model"] = "no-such-model"
    upload = client.files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    failed = wait_batch(client, batch.id, lambda b: b.status == "failed", server=server)
    found = {(e.line, e.code) for e in failed.errors.data}
    assert found == {(2, "invalid_json_line"), (4, "duplicate_custom_id"), (5, "model_not_found")}
    assert failed.failed_at and failed.output_file_id is None
    assert not (server.data_dir / "runs" / batch.id).exists()  # it never ran


def test_cancel_mid_run_keeps_the_rows_done(server):
    client = server.client()
    upload = client.files.create(
        file=("long.jsonl", jsonl(batch_lines(24, max_tokens=24))), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_batch(client, batch.id, lambda b: b.request_counts.completed >= 2, server=server)
    # watchable while it runs: its live page, its SSE stream, /metrics with the queue
    base = f"{server.base_url}/batches/{batch.id}/progress"
    status, page = _get(base + "/")
    assert status == 200 and b"<html" in page.lower()
    request = urllib.request.Request(base + f"/events?token={KEY}")
    with urllib.request.urlopen(request, timeout=30) as events:
        assert events.readline().startswith(b"event: snapshot")
    assert _get(base + "/", key=OTHER_KEY)[0] == 404
    status, metrics = _get(server.base_url.removesuffix("/v1") + "/metrics")
    assert status == 200 and b"batchrun_serve_running 1" in metrics
    assert b'batchrun_serve_batches{status="in_progress"} 1' in metrics
    assert b"batchrun_rows_done_total" in metrics  # the running batch's own

    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled", "completed")
    end = wait_batch(client, batch.id, lambda b: b.status in ("cancelled", "completed"))
    assert end.status == "cancelled", "the batch finished before the cancel; make it longer"
    assert end.cancelling_at and end.cancelled_at
    results = output_lines(client, end.output_file_id)
    ids = [r["custom_id"] for r in results]
    assert len(ids) == len(set(ids)) == end.request_counts.completed >= 2
    assert len(ids) < 24 and end.error_file_id is None  # the rest: nowhere
    assert committed_rows(server.data_dir, batch.id) == len(ids)
    time.sleep(0.5)
    assert client.batches.retrieve(batch.id).status == "cancelled"
    assert json.loads(_get(server.base_url + f"/batches/{batch.id}")[1])["status"] == "cancelled"


def test_the_docs_client_snippet_runs(server, tmp_path):
    code = client_snippet(REPO / "docs" / "serve.md")
    for old, new in SNIPPET:
        assert old in code, f"docs/serve.md's client no longer holds {old!r}: update SNIPPET"
        code = code.replace(old, new.format(url=server.base_url, key=KEY))
    (tmp_path / "client.py").write_text(code)
    done = subprocess.run(
        [sys.executable, "client.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:] + server.log()[-3000:]
    assert done.stdout.startswith("completed") and "q2 " in done.stdout, done.stdout


def test_the_readme_client_snippet_is_the_docs_one():
    """README's Batch API client (when it has one) is docs/serve.md's, which the test above
    runs."""
    readme = client_snippet(REPO / "README.md")
    if readme is None:
        pytest.skip("README.md has no Batch API client snippet")
    assert readme == client_snippet(REPO / "docs" / "serve.md")
