"""`batchrun tail URL`: follow a run's `--serve-progress` stream in the terminal.

One updating line on a TTY (one line per snapshot otherwise, e.g. into a log); with ``--rows``
the finished rows go to stdout as JSON lines and the snapshots to stderr. Ends at the server's
``event: end`` (the run completed, was interrupted or failed).
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import TextIO

import msgspec

from batchrun.progress.snapshot import Snapshot


class TailError(Exception):
    pass


def events_url(url: str, rows: bool) -> str:
    """The /events URL from the server's base URL (or from /events itself)."""
    parts = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
    path = parts.path.rstrip("/")
    if not path.endswith("/events"):
        path += "/events"
    query = urllib.parse.parse_qsl(parts.query)
    if rows:
        query.append(("rows", "1"))
    return urllib.parse.urlunsplit(parts._replace(path=path, query=urllib.parse.urlencode(query)))


def read_events(lines: Iterator[bytes]) -> Iterator[tuple[str, list[bytes]]]:
    """SSE framing: (event name, data lines) per blank-line-terminated event."""
    name, data = "message", []
    for raw in lines:
        line = raw.rstrip(b"\r\n")
        if not line:
            if data:
                yield name, data
            name, data = "message", []
        elif line.startswith(b"event:"):
            name = line[6:].strip().decode()
        elif line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
    if data:
        yield name, data


def snapshot_line(s: Snapshot) -> str:
    """One line: rows, output tok/s (last 20 s, and the attempt's average), input tok/s, cache
    hits, running / waiting requests, elapsed, ETA."""
    total = f"/{s.rows_total:,}" if s.rows_total is not None else ""
    shard = f"[shard {s.shard_index} of {s.num_shards}] " if s.num_shards > 1 else ""
    eta = f", ETA {s.eta_s:,.0f} s" if s.eta_s is not None else ""
    cached = s.cache_hit_rate if s.input_tokens else s.cached_fraction
    return (
        f"{shard}{s.status}: {s.rows_done:,}{total} rows ({s.rows_failed:,} failed), "
        f"{s.recent_tok_s:,.0f} tok/s (avg {s.output_tok_s:,.0f}), "
        f"in {s.recent_input_tok_s:,.0f} tok/s, cached {100 * cached:.1f}%, "
        f"{s.running:,} running, {s.waiting:,} waiting, {s.elapsed_s:,.1f} s{eta}"
    )


def tail(
    url: str,
    token: str | None = None,
    rows: bool = False,
    out: TextIO = sys.stdout,
    status: TextIO = sys.stderr,
) -> Snapshot | None:
    """Follow the stream until its end event; returns the last snapshot."""
    request = urllib.request.Request(events_url(url, rows), headers={"Accept": "text/event-stream"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        resp = urllib.request.urlopen(request, timeout=60)
    except urllib.error.HTTPError as e:
        hint = " (give --token)" if e.code == 401 else ""
        raise TailError(f"{url}: HTTP {e.code} {e.reason}{hint}") from e
    except (urllib.error.URLError, OSError) as e:
        raise TailError(f"{url}: cannot connect: {e}") from e
    decoder = msgspec.json.Decoder(Snapshot)
    tty = status.isatty()
    last = None
    with resp:
        for name, data in read_events(resp):
            if name == "snapshot":
                last = decoder.decode(data[0])
                if tty:
                    status.write("\r\x1b[K" + snapshot_line(last))
                else:
                    status.write(snapshot_line(last) + "\n")
                status.flush()
            elif name == "rows":
                out.write("".join(d.decode() + "\n" for d in data))
                out.flush()
            elif name == "end":
                if tty:
                    status.write("\n")
                return last
    raise TailError(f"{url}: the stream ended before the run did (server gone?)")
