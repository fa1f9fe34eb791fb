"""`submit --serve-progress` against a real server on loopback during real runs of the tiny chat
model: 50 concurrent SSE clients, /metrics, `batchrun tail`, the live page in headless Chromium
(a screenshot while a run goes, kept as test-artifacts/progress-page.png, its numbers checked
against /events; its final state), a client that never reads, and the token on a non-loopback
bind. Requests go to 127.0.0.1 only."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_tiny_chat_model  # noqa: E402

from batchrun.cli import main  # noqa: E402
from batchrun.job.summary import RunSummary  # noqa: E402
from batchrun.progress.server import ProgressHub, ProgressServer, Snapshot  # noqa: E402
from batchrun.progress.tail import read_events  # noqa: E402

CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None
)
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tinychat")
    make_tiny_chat_model(path)
    return str(path)


def dataset(tmp_path: Path, num_rows: int) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": f"r{i}", "prompt": f"Prompt number {i} about things"}) + "\n"
            for i in range(num_rows)
        )
    )
    return path


def start_submit(model: str, data: Path, out: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "batchrun.cli", "submit", str(data), "--out", str(out)]
    args += ["--model", model, "--device", "cpu", "--max-tokens", "64", "--ignore-eos"]
    args += ["--temperature", "0", "--kv-budget", "16384", "--quiet", *extra]
    return subprocess.Popen(args, stderr=subprocess.PIPE, text=True)


def wait_for_url(proc: subprocess.Popen) -> str:
    """The CLI prints `progress: URL` once the server listens (before the model loads)."""
    for line in proc.stderr:
        if line.startswith("progress: "):
            return line.split()[1]
    raise AssertionError(f"no progress URL; exit code {proc.wait()}")


def finish(proc: subprocess.Popen) -> str:
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, rest
    return rest


def read_stream(url: str, seconds: float, rows: bool = False) -> list[tuple[str, list[bytes]]]:
    """Read /events for at most `seconds` (or to its end event); every event parsed."""
    host, port = url.split("//")[1].strip("/").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/events?rows=1" if rows else "/events")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    deadline, events = time.monotonic() + seconds, []
    for name, data in read_events(resp):
        events.append((name, data))
        if name == "snapshot":
            msgspec.json.decode(data[0], type=Snapshot)  # well-formed and well-typed
        elif name == "rows":
            assert all("id" in json.loads(d) for d in data)
        if name == "end" or time.monotonic() > deadline:
            break
    conn.close()
    return events


def wait_until_running(url: str) -> None:
    """Follow the stream until the first row is done (the model is loaded, rows flow)."""
    conn = http.client.HTTPConnection(*url.split("//")[1].strip("/").split(":"), timeout=60)
    conn.request("GET", "/events")
    for name, data in read_events(conn.getresponse()):
        if name == "end" or (name == "snapshot" and b'"rows_done"' in data[0]):
            break
    conn.close()


def test_clients_metrics_tail_and_page_during_a_run(model, tmp_path):
    # 6,000 rows of 32 tokens: the run outlasts the clients' 2 s of reading (it takes ~9 s on
    # two cores at 21,000 tokens/s; 2,000 rows would end within 3 s of the start)
    args = ("--max-tokens", "32", "--serve-progress", ":0")
    proc = start_submit(model, dataset(tmp_path, 6000), tmp_path / "out", *args)
    url = wait_for_url(proc)
    assert url.startswith("http://127.0.0.1:")
    tail = subprocess.Popen(
        [sys.executable, "-m", "batchrun.cli", "tail", url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until_running(url)
    # the metrics first: on a fast machine the run may end soon after the clients' 2 s
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url + "metrics", timeout=10).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["batchrun_rows_done"].type == "counter"
    assert families["batchrun_rows"].samples[0].value == 6000
    results: list = [None] * 50
    errors: list = []

    def client(i: int) -> None:
        try:
            results[i] = read_stream(url, seconds=2.0, rows=i % 2 == 0)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[:3]
    for events in results:
        assert sum(name == "snapshot" for name, _ in events) >= 2
    assert any(name == "rows" for events in results[::2] for name, _ in events)

    finish(proc)
    tail_out, tail_err = tail.communicate(timeout=60)
    assert tail.returncode == 0, tail_err
    lines = tail_err.splitlines()
    assert len(lines) >= 2 and lines[-1].startswith("complete: 6,000/6,000 rows"), lines[-3:]


def chromium(tmp_path: Path, url: str, *args: str, timeout: float = 90) -> str:
    """Headless Chromium on `url` (a fresh profile); its stdout."""
    done = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic"]
        + ["--no-first-run", "--disable-background-networking", "--disable-component-update"]
        + ["--disable-sync", f"--user-data-dir={tmp_path / 'chromium'}", *args, url],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done.stdout


def page_text(dom: str, element_id: str) -> str:
    found = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', dom)
    assert found, f"no element {element_id} in the page"
    return found.group(1)


def page_number(dom: str, element_id: str) -> float:
    return float(page_text(dom, element_id).replace(",", ""))


def secs(s: float | None) -> str:
    """The page's duration format."""
    if s is None:
        return "\u2014"
    s = int(s + 0.5)
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 60} min {s % 60} s" if s >= 60 else f"{s} s"


class Follower(threading.Thread):
    """Reads /events to its end in the background; keeps every snapshot."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.snapshots = url, []
        self.going = threading.Event()  # set once rows finish and tokens flow

    def run(self) -> None:
        conn = http.client.HTTPConnection(
            *self.url.split("//")[1].strip("/").split(":"), timeout=120
        )
        conn.request("GET", "/events")
        for name, data in read_events(conn.getresponse()):
            if name == "end":
                break
            if name == "snapshot":
                snap = msgspec.json.decode(data[0], type=Snapshot)
                self.snapshots.append(snap)
                if snap.rows_done and snap.recent_tok_s and snap.elapsed_s >= 3:
                    self.going.set()
        self.going.set()
        conn.close()


ROWS = 40_000


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (CI installs it)")
def test_live_page_screenshot_while_running_matches_events(model, tmp_path):
    # short rows, ordered a few hundred at a time: rows finish within seconds of the start,
    # and the run goes on far longer than the test looks at it (40,000 rows of 16 tokens take
    # 28 s on two CPU cores at 23,000 tokens/s; 5,000 take 3.3 s, less than the test's look)
    args = ("--max-tokens", "16", "--order-window", "256", "--drain-timeout", "5")
    proc = start_submit(
        model, dataset(tmp_path, ROWS), tmp_path / "out", *args, "--serve-progress", ":0"
    )
    follower = Follower(wait_for_url(proc))
    url = follower.url
    follower.start()
    assert follower.going.wait(timeout=120)
    ARTIFACTS.mkdir(exist_ok=True)
    png = ARTIFACTS / "progress-page.png"
    png.unlink(missing_ok=True)
    chromium(tmp_path, url, f"--screenshot={png}", "--window-size=1280,900")
    dom = chromium(tmp_path, url, "--dump-dom")  # the page as served, and its first events
    proc.send_signal(signal.SIGINT)  # stop the run: drain, commit, exit 5
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 5, rest
    follower.join(timeout=30)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000

    # the snapshot the page shows is one /events sent (the same tick: the same numbers)
    shown = float(dom.split('data-elapsed="')[1].split('"')[0])
    snap = next(s for s in follower.snapshots if s.elapsed_s == shown)
    assert snap.status == "running" == page_text(dom, "status")
    assert 0 < snap.rows_done < ROWS and snap.output_tokens > 0 and snap.recent_tok_s > 0
    for field in ("rows_done", "rows_total", "rows_failed", "rows_ok", "output_tokens"):
        assert page_number(dom, field) == getattr(snap, field), field
    for field in ("running", "waiting", "kv_used", "kv_total"):
        assert page_number(dom, field) == getattr(snap, field), field
    for field in ("recent_tok_s", "output_tok_s", "recent_input_tok_s", "input_tok_s"):
        assert abs(page_number(dom, field) - getattr(snap, field)) <= 0.5, field
    assert abs(page_number(dom, "cache_hit") - 100 * snap.cache_hit_rate) <= 0.05
    assert snap.cache_hit_rate > 0  # the chat template's shared prefix
    assert page_text(dom, "eta") == secs(snap.eta_s) and snap.eta_s is not None
    assert page_text(dom, "elapsed") == secs(snap.elapsed_s)
    # the last snapshot: interrupted
    assert follower.snapshots[-1].status == "interrupted"


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (CI installs it)")
def test_live_page_follows_a_run_to_its_end(model, tmp_path):
    # the page loads while the model does (the URL comes first), and the run (2.7 s on two
    # cores) gives it time to show a first snapshot before the end
    args = ("--max-tokens", "16", "--serve-progress", ":0")
    proc = start_submit(model, dataset(tmp_path, 4000), tmp_path / "out", *args)
    url = wait_for_url(proc)
    # --dump-dom waits for the page's network: it dumps when the stream ends with the run
    dom = chromium(tmp_path, url, "--dump-dom", "--virtual-time-budget=60000", timeout=300)
    finish(proc)

    def attr(name: str) -> int:
        return int(dom.split(f'data-{name}="')[1].split('"')[0])

    assert attr("snapshots") >= 2, dom[-2000:]
    assert attr("rows-done") == 4000 > attr("first-rows-done")
    assert 'id="rows_done">4,000<' in dom
    assert page_text(dom, "status") == "complete" and page_text(dom, "eta") == "\u2014"
    assert re.search(r'id="final" class="complete">Run complete: 4,000 rows \(0 failed\)', dom)


def test_a_client_that_never_reads_does_not_stall_the_run(model, tmp_path):
    data = dataset(tmp_path, 300)
    start = time.monotonic()
    finish(start_submit(model, data, tmp_path / "base"))
    baseline = time.monotonic() - start

    start = time.monotonic()
    proc = start_submit(model, data, tmp_path / "stuck", "--serve-progress", "127.0.0.1:0")
    port = int(wait_for_url(proc).rstrip("/").rsplit(":", 1)[1])
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fill up fast
    stuck.connect(("127.0.0.1", port))
    stuck.sendall(b"GET /events?rows=1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    finish(proc)  # never reads a byte
    with_stuck = time.monotonic() - start
    stuck.close()
    assert with_stuck < 3 * baseline + 10, (with_stuck, baseline)
    lines = (tmp_path / "stuck" / "results-00000.jsonl").read_text().splitlines()
    assert len(lines) == 300


def test_token_required_on_a_non_loopback_bind(model, tmp_path):
    data = dataset(tmp_path, 2)
    args = ["submit", str(data), "--out", str(tmp_path / "o"), "--model", model, "--quiet"]
    result = CliRunner().invoke(main, [*args, "--serve-progress", "0.0.0.0:0"])
    assert result.exit_code == 2
    assert "--progress-token" in result.output and "loopback" in result.output
    assert not (tmp_path / "o").exists()  # failed fast: nothing started

    hub = ProgressHub()
    server = ProgressServer(hub, "0.0.0.0", 0, token="s3cret").start()
    try:
        hub.start(10, RunSummary(rows=3))
        base = f"http://127.0.0.1:{server.port}"

        def status(path: str, headers: dict | None = None) -> int:
            request = urllib.request.Request(base + path, headers=headers or {})
            try:
                with urllib.request.urlopen(request, timeout=10) as resp:
                    return resp.status
            except urllib.error.HTTPError as e:
                return e.code

        for path in ("/", "/metrics", "/events"):
            assert status(path) == 401
            assert status(path, {"Authorization": "Bearer wrong"}) == 401
        assert status("/metrics", {"Authorization": "Bearer s3cret"}) == 200
        assert status("/?token=s3cret") == 200
        hub.finish("complete")  # /events then ends at once with the end event
        assert status("/events?token=s3cret") == 200
    finally:
        server.stop()
