"""A batch's output and error files, made from its run directory (or a sharded run's shards):
the committed records only (each shard file up to the length its manifest committed), so a
cancelled or expired batch gives exactly the rows done, and a restart that redoes this step
writes the same files under the same ids."""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from batchrun.io.manifest import read_manifest
from batchrun.io.writer import fsync_dir
from batchrun.serve.config import Layout
from batchrun.serve.store import Store


@dataclass(frozen=True)
class Outcome:
    completed: int
    failed: int
    output_file_id: str | None
    error_file_id: str | None
    usage: dict  # OpenAI's batch usage: the tokens of the rows done


def derived_file_id(batch_id: str, kind: str) -> str:
    """The same id every time the batch is finalized (a restart mid-way overwrites, never adds)."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


def run_dirs(run: Path) -> list[Path]:
    """The run directory, or its shard-*/ directories for a sharded (Slurm array) run."""
    shards = sorted(p for p in run.glob("shard-*") if p.is_dir())
    return shards or [run]


def finalize(store: Store, layout: Layout, batch_id: str, owner: str) -> Outcome:
    completed = failed = prompt = cached = output = 0
    parts: dict[str, list[tuple[Path, int | None]]] = {"results": [], "errors": []}
    run = layout.run_dir(batch_id)
    for d in run_dirs(run) if run.exists() else []:
        manifest = read_manifest(d)
        if manifest is None:
            continue
        completed += manifest.counts.rows_ok
        failed += manifest.counts.rows_failed
        prompt += manifest.counts.prompt_tokens
        cached += manifest.counts.cached_tokens
        output += manifest.counts.completion_tokens
        for f in manifest.files:
            kind = Path(f.path).name.split("-", 1)[0]
            if kind in parts and f.rows:
                parts[kind].append((d / f.path, f.bytes))
    ids = {}
    for kind, purpose in (("results", "batch_output"), ("errors", "batch_output")):
        if not parts[kind]:
            ids[kind] = None
            continue
        file_id = derived_file_id(batch_id, kind)
        size = _concatenate(parts[kind], layout.file_path(file_id), layout.tmp)
        name = f"{batch_id}_{'output' if kind == 'results' else 'error'}.jsonl"
        store.put_file(file_id, owner, purpose, name, size)
        ids[kind] = file_id
    usage = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }
    return Outcome(completed, failed, ids["results"], ids["errors"], usage)


def _concatenate(parts: list[tuple[Path, int | None]], dest: Path, tmp_dir: Path) -> int:
    tmp = tmp_dir / (dest.name + ".part")
    size = 0
    with open(tmp, "wb") as out:
        for path, length in parts:
            with open(path, "rb") as src:
                if length is None:
                    shutil.copyfileobj(src, out)
                    size += path.stat().st_size
                    continue
                left = length
                while left > 0:
                    chunk = src.read(min(left, 1 << 20))
                    if not chunk:
                        break
                    out.write(chunk)
                    left -= len(chunk)
                size += length - left
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, dest)
    fsync_dir(dest.parent)
    return size
