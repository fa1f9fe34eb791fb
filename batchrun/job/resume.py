"""What a run's output depends on (its fingerprint), and the checks before resuming one.

Running ``submit`` again with the same --out resumes the run when the fingerprint is the same
and refuses otherwise: rows from two different runs must never share an output. Identities are
by content, not by path, so a dataset or model copied to another node (or mounted elsewhere)
still resumes; cheap enough for huge inputs (sizes plus hashes of each file's first and last
64 KiB, at most MAX_HASHED files; config.json and the weight files' names and sizes, and
--quantization, which changes the model that runs). The thinking budget (--max-thinking-tokens)
is a sampling default; the reasoning and tool-call parsers are output options.

Not in the fingerprint, so they may change between attempts: device, dtype, KV cache dtype, KV
budget, max-running, chunked prefill, attention backend, shard size, commit and drain settings.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from pathlib import Path
from typing import Any

import msgspec

from batchrun import __version__
from batchrun.job.config import SAMPLING_OPTIONS, RunConfig
from batchrun.params import SamplingParams

EDGE_BYTES = 64 * 1024
MAX_HASHED = 64
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")

# fingerprint key -> how the refusal message names it
LABELS = {
    "batchrun_version": "batchrun version",
    "model": "model (config.json or weight files)",
    "input": "input dataset (content, format or split)",
    "sampling": "sampling defaults",
    "rows": "row options (columns, system prompt, chat template, --chat-template, "
    "--chat-template-kwargs, --limit, --max-model-len)",
    "order": "--order / --order-window",
    "shards": "--num-shards / --shard-index",
    "seed": "--seed",
    "output": "output options (--token-ids, --keep-columns, --reasoning-parser, "
    "--tool-call-parser)",
    "task": "--task and its options (--pooling, --dimensions, --query-prefix, ...)",
}


def _edges_digest(h: Any, path: Path, size: int) -> None:
    with open(path, "rb") as f:
        h.update(f.read(EDGE_BYTES))
        if size > 2 * EDGE_BYTES:
            f.seek(size - EDGE_BYTES)
            h.update(f.read(EDGE_BYTES))


def _files_identity(root: Path, files: list[Path]) -> dict:
    h = hashlib.blake2b(digest_size=16)
    total = 0
    for i, f in enumerate(files):
        size = f.stat().st_size
        total += size
        h.update(f"{f.relative_to(root) if f != root else f.name}\0{size}\0".encode())
        if i < MAX_HASHED:
            _edges_digest(h, f, size)
    return {"files": len(files), "bytes": total, "digest": h.hexdigest()}


def input_identity(dataset: str | Path, fmt: str, split: str | None) -> dict:
    path = Path(dataset).expanduser()
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and not any(part.startswith((".", "_")) for part in p.relative_to(path).parts)
        )
    else:
        files = [path]
    return {"format": fmt, "split": split, **_files_identity(path, files)}


def model_identity(model: str | None, load_format: str, quantization: str | None = None) -> dict:
    """The model's identity; `quantization` (--quantization) is part of it when given."""
    ident = _model_files_identity(model, load_format)
    if quantization is not None:
        ident["quantization"] = quantization
    return ident


def _model_files_identity(model: str | None, load_format: str) -> dict:
    if model is None:
        return {"name": "embedded:SmolLM2-135M-Instruct"}
    path = Path(model).expanduser()
    if path.is_file():
        return {"load_format": load_format, **_files_identity(path, [path])}
    if not path.is_dir():
        return {"missing": str(path)}  # the engine then fails to load it (exit 4)
    config = path / "config.json"
    ident: dict[str, Any] = {"load_format": load_format}
    if config.is_file():
        ident["config"] = hashlib.blake2b(config.read_bytes(), digest_size=16).hexdigest()
    if load_format != "dummy":
        ident["weights"] = sorted(
            [p.name, p.stat().st_size]
            for p in path.iterdir()
            if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)
        )
    return ident


def make_fingerprint(config: RunConfig, input_format: str, input_ident: dict | None = None) -> dict:
    """JSON-ready dict of everything the rows' output depends on. ``input_ident``: the input's
    identity when it is not the file ``config.dataset`` names (standard input: its content's)."""
    cfg = config
    output: dict[str, Any] = {"token_ids": cfg.with_token_ids}
    if cfg.spec.keep_columns:  # NOTE: only when given, so runs without it keep their fingerprint
        output["keep_columns"] = list(cfg.spec.keep_columns)
    # what of the output is reasoning and which parts are tool calls (the default: no key)
    for key in ("reasoning_parser", "tool_call_parser"):
        if getattr(cfg, key) != "auto":
            output[key] = getattr(cfg, key)
    fp = {
        "batchrun_version": __version__,
        "model": model_identity(cfg.engine.model, cfg.engine.load_format, cfg.engine.quantization),
        "input": input_ident or input_identity(cfg.dataset, input_format, cfg.split),
        "sampling": msgspec.to_builtins(cfg.defaults),
        "rows": _rows_identity(config),
        "order": [cfg.order, cfg.order_window],
        "shards": [cfg.num_shards, cfg.shard_index],
        "seed": cfg.engine.seed,
        "output": output,
    }
    if cfg.pooling is not None:  # NOTE: only for pooling tasks: generate runs keep theirs
        fp["task"] = cfg.pooling.fingerprint()
    return fp


def _rows_identity(config: RunConfig) -> dict:
    """The row options, --limit and --max-model-len (only when given); a --chat-template by a
    digest of its text (no key without one)."""
    rows = {**asdict(config.spec), "limit": config.limit}
    if config.engine.context_len is not None:  # --max-model-len: which rows fail as too long
        rows["max_model_len"] = config.engine.context_len
    rows.pop("keep_columns")  # an output option (the fingerprint's "output")
    if rows["chat_template_kwargs"] is None:  # only when given (--chat-template-kwargs)
        rows.pop("chat_template_kwargs")
    template = rows.pop("chat_template")
    if template is not None:
        rows["chat_template"] = hashlib.blake2b(template.encode(), digest_size=16).hexdigest()
    return rows


def normalize(fp: dict) -> dict:
    """A fingerprint as read back from JSON (tuples become lists)."""
    return msgspec.json.decode(msgspec.json.encode(fp))


def fingerprint_diff(old: dict, new: dict, ignore: tuple[str, ...] = ()) -> list[str]:
    """Readable descriptions of what differs between two fingerprints."""
    old, new = normalize(old), normalize(new)
    out = []
    for key in sorted(set(old) | set(new)):
        if key in ignore or old.get(key) == new.get(key):
            continue
        label = LABELS.get(key, key)
        if key in ("batchrun_version", "order", "shards", "seed"):
            label += f": was {old.get(key)}, now {new.get(key)}"
        elif key == "sampling":
            # the fingerprint omits the fields at SamplingParams' defaults: show those values
            base = normalize(msgspec.structs.asdict(SamplingParams()))
            a, b = {**base, **(old.get(key) or {})}, {**base, **(new.get(key) or {})}
            changed = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            label += ": " + ", ".join(
                f"{SAMPLING_OPTIONS.get(k, k)} {a.get(k)} -> {b.get(k)}" for k in changed
            )
        out.append(label)
    return out
