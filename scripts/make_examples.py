"""Regenerate examples/prompts.parquet from examples/prompts.jsonl, so the two never drift.

    python scripts/make_examples.py           # write the Parquet file
    python scripts/make_examples.py --check   # exit 1 if the Parquet file is stale

The schema is explicit rather than inferred, so that every row carries every column (null where a
row does not use it) with stable types:

    id           string
    prompt       string                                  (null in chat rows)
    messages     list<struct<role: string, content: string>>  (null in prompt rows)
    max_tokens   int64                                   (null: use the CLI default)
    temperature  double                                  (null: use the CLI default)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from benchlib import ROOT

EXAMPLES = ROOT / "examples"
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("prompt", pa.string()),
        ("messages", pa.list_(MESSAGE)),
        ("max_tokens", pa.int64()),
        ("temperature", pa.float64()),
    ]
)


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        unknown = set(row) - set(SCHEMA.names)
        if unknown:
            raise SystemExit(f"{path}:{line_no}: unknown columns {sorted(unknown)}")
        if (row.get("prompt") is None) == (row.get("messages") is None):
            raise SystemExit(f"{path}:{line_no}: a row needs exactly one of prompt / messages")
        rows.append({name: row.get(name) for name in SCHEMA.names})
    return rows


def to_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=EXAMPLES / "prompts.jsonl")
    parser.add_argument("--dst", type=Path, default=EXAMPLES / "prompts.parquet")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when stale")
    args = parser.parse_args()

    table = to_table(read_jsonl(args.src))
    if args.check:
        if not args.dst.exists():
            print(f"{args.dst} is missing; run {sys.argv[0]}", file=sys.stderr)
            return 1
        current = pq.read_table(args.dst)
        if not current.schema.equals(table.schema) or current.to_pylist() != table.to_pylist():
            print(f"{args.dst} is stale; run {sys.argv[0]}", file=sys.stderr)
            return 1
        print(f"{args.dst} matches {args.src} ({table.num_rows} rows)")
        return 0
    # NOTE: one small row group and no dictionary encoding keep the file diff-friendly in size
    # and trivially readable by any Parquet reader.
    pq.write_table(table, args.dst, compression="zstd", use_dictionary=False)
    print(f"wrote {args.dst}: {table.num_rows} rows, schema:\n{table.schema}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
