"""The progress hub and server policy without a run: binds, the back-pressure policy (latest
snapshot only, rows queue bounded, overflowing clients dropped), the metrics text, SSE framing."""

from __future__ import annotations

import asyncio
import io

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchrun.job.summary import RunSummary
from batchrun.progress.server import (
    CLIENT_QUEUE,
    ProgressHub,
    ProgressServer,
    Snapshot,
    _Client,
    is_loopback,
    metrics_text,
    parse_bind,
)
from batchrun.progress.tail import events_url, read_events, snapshot_line


def test_parse_bind_and_loopback():
    assert parse_bind(":8765") == ("127.0.0.1", 8765)
    assert parse_bind("0.0.0.0:80") == ("0.0.0.0", 80)
    assert parse_bind("[::1]:9") == ("::1", 9)
    for bad in ("8765", "host:", "h:99999", "h:x"):
        with pytest.raises(ValueError):
            parse_bind(bad)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")
    with pytest.raises(ValueError, match="--progress-token"):
        ProgressServer(ProgressHub(), "0.0.0.0", 0)


def test_hub_keeps_rows_only_when_wanted_and_bounded():
    hub = ProgressHub(max_rows=4)
    hub.add_rows([b"a\n"])
    assert hub.drain()[4] == []  # nobody wants rows: none kept
    hub.want_rows = True
    hub.add_rows([b"a\n", b"b\n"])
    assert hub.drain()[4:] == ([b"a\n", b"b\n"], False)
    hub.add_rows([b"x\n"] * 5)  # past max_rows: dropped, and said so
    assert hub.drain()[4:] == ([], True)
    hub.start(10, RunSummary(rows=3, session_tokens=7))
    counts, total, _, status, _, _ = hub.drain()
    assert (counts[0], counts[-1], total, status) == (3, 7, 10, "running")
    hub.finish("complete")
    assert hub.is_finished


def test_slow_client_keeps_the_latest_snapshot_and_overflow_drops_it():
    async def scenario():
        server = ProgressServer(ProgressHub(), "127.0.0.1", 0)
        server.hub.want_rows = True
        never_reads = asyncio.ensure_future(asyncio.sleep(3600))
        snapshots_only = _Client(rows=False)
        rows_client = _Client(rows=True)
        rows_client.task = never_reads
        server._clients |= {snapshots_only, rows_client}
        for i in range(CLIENT_QUEUE + 1):
            server.hub.add_rows([b'{"id":"%d"}\n' % i])
            server._tick()
        await asyncio.sleep(0)
        assert rows_client not in server._clients and never_reads.cancelled()
        assert snapshots_only in server._clients
        assert not snapshots_only.queue  # rows are not queued for a snapshots client
        snap = msgspec.json.decode(snapshots_only.snapshot.split(b"data: ")[1], type=Snapshot)
        assert snap.clients == 2 and snap.status == "starting"  # the latest one only

    asyncio.run(scenario())


def test_metrics_text_parses():
    snap = Snapshot(rows_done=5, rows_total=None, output_tok_s=1.5, eta_s=None)
    families = {f.name: f for f in text_string_to_metric_families(metrics_text(snap))}
    assert families["batchrun_rows_done"].type == "counter"
    assert families["batchrun_rows_done"].samples[0].value == 5
    assert families["batchrun_cached_fraction"].type == "gauge"
    assert families["batchrun_running"].samples[0].value == 1


def test_snapshot_omits_defaults_and_tail_reads_sse():
    assert msgspec.json.encode(Snapshot(rows_done=2)) == b'{"rows_done":2}'
    stream = io.BytesIO(
        b'event: snapshot\ndata: {"rows_done":2,"rows_total":4}\n\n'
        b'event: rows\ndata: {"id":"a"}\ndata: {"id":"b"}\n\n: comment\n\nevent: end\ndata: {}\n\n'
    )
    events = list(read_events(stream))
    assert [name for name, _ in events] == ["snapshot", "rows", "end"]
    assert events[1][1] == [b'{"id":"a"}', b'{"id":"b"}']
    line = snapshot_line(msgspec.json.decode(events[0][1][0], type=Snapshot))
    assert line.startswith("running: 2/4 rows")
    assert events_url("http://h:1/", rows=True) == "http://h:1/events?rows=1"
    assert events_url("h:1/events?token=t", rows=False) == "http://h:1/events?token=t"
