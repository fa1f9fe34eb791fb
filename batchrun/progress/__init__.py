"""Progress of a run: the terminal bar (bar.py), the hub that serves snapshots and rows to
clients (hub.py), the HTTP server with its SSE stream and live page (server.py, index.html), and
`batchrun tail` (tail.py)."""
