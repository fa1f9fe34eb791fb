"""`batchrun submit` on the embedded SmolLM2-135M, and the streaming memory bound on a 200,000-row
Parquet file (plan and submit --limit 50 run in subprocesses; their peak RSS is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchrun.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _as_format(name: str, tmp_path: Path) -> Path:
    """The example prompts in another input format: .jsonl.gz, or a HF datasets directory."""
    import gzip

    rows = (EXAMPLES / "prompts.jsonl").read_bytes()
    if name == "prompts.jsonl.gz":
        path = tmp_path / name
        path.write_bytes(gzip.compress(rows))
        return path
    if name == "hf-datasets":
        import datasets

        records = [json.loads(line) for line in rows.splitlines() if line.strip()]
        plain = [{"id": r["id"], "prompt": r["prompt"]} for r in records if "prompt" in r]
        path = tmp_path / "hf"
        datasets.Dataset.from_list(plain).save_to_disk(path)
        return path
    return EXAMPLES / name


@pytest.mark.parametrize(
    "name",
    ["prompts.jsonl", "prompts.jsonl.gz", "prompts.parquet", "hf-datasets", "openai_batch.jsonl"],
)
def test_examples_on_embedded_model(name, tmp_path):
    out = tmp_path / "out"
    args = [
        "submit",
        str(_as_format(name, tmp_path)),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--limit",
        "6",
        "--max-tokens",
        "16",
        "--temperature",
        "0",
        "--quiet",
    ]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, (r.output, r.exception)
    lines = [json.loads(x) for p in out.glob("results-*.jsonl") for x in p.read_text().splitlines()]
    assert len(lines) >= 6
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["rows_ok"] == 6
    if name.startswith("openai"):
        assert all(x["response"]["status_code"] == 200 for x in lines)
        assert all(x["response"]["body"]["choices"][0]["message"]["content"] for x in lines)
    else:
        assert all(x["text"].strip() for x in lines)


def _peak_rss_mib(cmd: list[str]) -> float:
    """Run cmd in a fresh Python child; return that child's peak RSS in MiB."""
    code = (
        "import re, sys; from batchrun.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
        # NOTE: VmHWM, not getrusage's ru_maxrss: that one survives fork + exec, so the child
        # would report the (large) pytest parent's peak
        "hwm = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)\n"
        "print('PEAK_RSS_KB', hwm)\n"
        "sys.exit(rc or 0)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *cmd], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    kb = int(proc.stdout.rsplit("PEAK_RSS_KB", 1)[1].split()[0])
    return kb / 1024


@pytest.mark.slow
def test_200k_row_parquet_streams_within_memory_bound(tmp_path):
    path = tmp_path / "big.parquet"
    writer = None
    for start in range(0, 200_000, 20_000):
        table = pa.table(
            {
                "id": [f"row-{i}" for i in range(start, start + 20_000)],
                "prompt": [
                    f"Write one sentence about the number {i}."
                    for i in range(start, start + 20_000)
                ],
            }
        )
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()
    peak_submit = _peak_rss_mib(
        [
            "submit",
            str(path),
            "--out",
            str(tmp_path / "o"),
            "--device",
            "cpu",
            "--limit",
            "50",
            "--max-tokens",
            "4",
            "--quiet",
            "--kv-budget",
            "4096",
        ]
    )
    assert peak_submit < 2048, peak_submit  # the model is ~0.5 GiB (fp32) of that
    peak_plan = _peak_rss_mib(["plan", str(path), "--no-chat-template"])
    assert peak_plan < 1024, peak_plan  # the tokenizer only: no weights loaded
    print(f"peak RSS: submit --limit 50 {peak_submit:.0f} MiB, plan {peak_plan:.0f} MiB")
