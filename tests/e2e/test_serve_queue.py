"""The serve worker with a stand-in backend (no model, fast): first in first out, a restart
takes the batch it was on first, cancel before a batch starts, expiry queued and mid-run, and
the output files hold exactly the committed records of the run directory."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

from batchrun.io.manifest import Counts, InputInfo, Manifest, write_manifest
from batchrun.io.writer import ShardFile
from batchrun.serve.config import Layout, ServeConfig
from batchrun.serve.executor import Executor
from batchrun.serve.objects import new_batch
from batchrun.serve.store import Store, new_id

OWNER = "key-test"


class StandIn:
    """Runs a batch by writing one committed record per row (and a torn tail past it); with
    `block`, waits for a stop instead."""

    def __init__(self, layout: Layout, block: bool = False):
        self.layout, self.block = layout, block
        self.ran: list[str] = []
        self._wake = threading.Event()

    def run(self, batch: dict, stop_reason) -> bool:
        self.ran.append(batch["id"])
        if self.block:
            while stop_reason() is None:
                self._wake.wait(0.05)
            return False
        run = self.layout.run_dir(batch["id"])
        run.mkdir(parents=True)
        line = json.dumps({"custom_id": "a", "response": None, "error": None}).encode() + b"\n"
        (run / "results-00000.jsonl").write_bytes(line + b'{"custom_id": "torn')
        manifest = Manifest(
            created="now", model="m", input=InputInfo("in", "jsonl"), status="complete",
            counts=Counts(rows_total=1, rows_ok=1), files=[ShardFile("results-00000.jsonl", 1,
            len(line))],
        )  # fmt: skip
        write_manifest(run, manifest)
        return True

    def stop(self) -> None:
        self._wake.set()

    def live_counts(self):
        return None

    def close(self) -> None:
        pass


@pytest.fixture
def env(tmp_path: Path):
    layout = Layout(tmp_path / "data").make()
    store = Store(layout.db)
    config = ServeConfig(data_dir=layout.root, models=(("m", None),))
    yield config, store, layout
    store.close()


def add(store: Store, layout: Layout, expires_in: float = 3600) -> dict:
    file_id = new_id("file-")
    line = {"custom_id": "a", "url": "/v1/chat/completions", "body": {"model": "m"}}
    layout.file_path(file_id).write_text(json.dumps(line) + "\n")
    store.add_file(file_id, OWNER, "batch", "in.jsonl", 1)
    batch = new_batch(file_id, "/v1/chat/completions", "24h", 3600, None)
    batch["expires_at"] = int(time.time() + expires_in)
    store.add_batch(batch, OWNER)
    return batch


def wait_final(store: Store, batch_id: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = store.get_batch(batch_id)
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.02)
    raise AssertionError(store.get_batch(batch_id))


def test_fifo_and_committed_records_only(env):
    config, store, layout = env
    batches = [add(store, layout) for _ in range(3)]
    backend = StandIn(layout)
    executor = Executor(config, store, layout, backend).start()
    try:
        done = [wait_final(store, b["id"]) for b in batches]
    finally:
        executor.stop()
    assert backend.ran == [b["id"] for b in batches]
    for b in done:
        assert b["status"] == "completed" and b["request_counts"]["completed"] == 1
        text = layout.file_path(b["output_file_id"]).read_text()
        assert text.endswith("\n") and "torn" not in text  # past the committed length: not out
        assert store.get_file(b["output_file_id"], OWNER)["purpose"] == "batch_output"


def test_restart_takes_the_batch_it_was_on_first(env):
    config, store, layout = env
    older, taken = add(store, layout), add(store, layout)
    store.update_batch(taken["id"], status="in_progress", model="m")
    store._db.execute("UPDATE batches SET started = 1 WHERE id = ?", (taken["id"],))
    backend = StandIn(layout)
    executor = Executor(config, store, layout, backend).start()
    try:
        wait_final(store, older["id"])
    finally:
        executor.stop()
    assert backend.ran == [taken["id"], older["id"]]


def test_cancel_before_start_and_expiry(env):
    config, store, layout = env
    running, queued = add(store, layout, expires_in=1.5), add(store, layout)
    expired = add(store, layout, expires_in=-1)
    backend = StandIn(layout, block=True)
    executor = Executor(config, store, layout, backend).start()
    try:
        deadline = time.monotonic() + 10
        while backend.ran != [running["id"]] and time.monotonic() < deadline:
            time.sleep(0.02)
        batch, act = store.cancel_batch(queued["id"], OWNER)
        assert batch["status"] == "cancelled" and not act  # never taken: ends at once
        assert store.cancel_batch(queued["id"], "key-other") == (None, False)
        end = wait_final(store, running["id"])  # its window passes mid-run
        assert end["status"] == "expired" and end["expired_at"]
        assert wait_final(store, expired["id"])["status"] == "expired"
    finally:
        executor.stop()
    assert backend.ran == [running["id"]]  # the cancelled and the expired ones never ran
    assert store.get_batch(queued["id"])["cancelled_at"]


def test_the_engine_stays_loaded_for_the_same_model(monkeypatch, tmp_path):
    import batchrun.serve.engines as engines

    started: list[str | None] = []
    closed: list[str | None] = []

    class FakeEngine:
        def __init__(self, config, **kwargs):
            self.model = config.model
            started.append(config.model)

        def close(self) -> None:
            closed.append(self.model)

    monkeypatch.setattr(engines, "EngineProcess", FakeEngine)
    config = ServeConfig(data_dir=tmp_path, models=(("a", "/m/a"), ("b", "/m/b")))
    pool = engines.EnginePool(config)
    first = pool.get("a")
    assert pool.get("a") is first and started == ["/m/a"]  # kept for the next batch
    pool.get("b")
    assert started == ["/m/a", "/m/b"] and closed == ["/m/a"]
    pool.close()
    assert closed == ["/m/a", "/m/b"]


def test_cli_refuses_what_it_cannot_serve(tmp_path):
    from click.testing import CliRunner

    from batchrun.cli import main

    def serve(*args: str):
        return CliRunner().invoke(main, ["serve", "--data-dir", str(tmp_path), *args])

    r = serve("--host", "0.0.0.0", "--device", "cpu")
    assert r.exit_code == 2 and "--api-key-file" in r.output
    (tmp_path / "keys").write_text("short\n")
    r = serve("--api-key-file", str(tmp_path / "keys"), "--device", "cpu")
    assert r.exit_code == 2 and "16 characters" in r.output
    r = serve("--model", "no-equals-sign", "--device", "cpu")
    assert r.exit_code == 2 and "NAME=PATH" in r.output
    r = serve("--executor", "slurm", "--max-running", "4")
    assert r.exit_code == 2 and "--slurm-submit-arg" in r.output


def test_serve_help_reads_section_by_section():
    """As test_cli_help.py holds submit and plan to: every option with a one-line help, a
    default and a section; the sections in order, each a screen."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from test_cli_help import SCREEN, help_sections, options

    from batchrun.cli.options import ENGINE, KERNELS
    from batchrun.cli.sections import OTHER, section_of
    from batchrun.serve.cli import SERVER, SLURM

    params, ctx = options("serve")
    for param in params:
        if "--help" in param.opts:
            continue
        assert section_of(param) in (SERVER, ENGINE, KERNELS, SLURM), param.opts
        assert param.help and "\n" not in param.help.strip(), param.opts
        _, record = param.get_help_record(ctx)
        if not param.is_flag or param.secondary_opts:
            assert param.required or "default: " in record, f"{param.opts} shows no default"
    for width in (80, 100):
        sections = help_sections("serve", width)
        assert list(sections) == [SERVER, ENGINE, KERNELS, SLURM, OTHER]
        assert all(len(lines) <= SCREEN for lines in sections.values()), width
