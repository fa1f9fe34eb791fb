"""`batchrun plan`: what a run would do, without loading weights.

Streams the dataset through the same row pipeline as `submit` (read -> prepare -> tokenize) and
keeps only a few integers per row plus the token ids of one ordering window (4 bytes a token), so
it runs on files far larger than memory.
"""

from __future__ import annotations

import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from batchrun.config import EngineConfig, resolve_sizes
from batchrun.engine.state_snapshots import (
    MIN_SNAPSHOT_PREFIX,
    SNAPSHOT_LOOKAHEAD,
    num_snapshots,
)
from batchrun.engine.window_pool import uses_window_pool
from batchrun.errors import ModelConfigError
from batchrun.io.readers import BadInputError, open_dataset
from batchrun.io.rows import RowError, RowSpec, schema_problem
from batchrun.io.stdin import STDIN, spool_stdin
from batchrun.job.config import default_served_model_name
from batchrun.job.kv_bytes import KVElement, gb, kv_bytes_line, window_bytes_line
from batchrun.job.order import (
    DEFAULT_WINDOW,
    LRUEstimate,
    dfs_order,
    predicted_reuse,
    reuse_lens,
    snapshot_reuse_lens,
    sort_key,
)
from batchrun.job.pipeline import RowPipeline
from batchrun.models.config import ModelConfig
from batchrun.models.context import served_context_len
from batchrun.models.embedded import resolve_model_path
from batchrun.models.hub import load_tokenizer
from batchrun.models.moe_weights import describe_experts
from batchrun.models.param_count import describe_params
from batchrun.params import SamplingParams
from batchrun.quant.online import with_quantization


class PlanError(Exception):
    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def load_tokenizer_and_context(model: str | None, quantization: str | None = None):
    """Tokenizer and config (context length, quantization) of a model directory (converting a
    GGUF once if needed)."""
    try:
        path = resolve_model_path(model)
        cfg = with_quantization(ModelConfig.from_dir(path), quantization, model)
    except (ValueError, OSError) as e:
        raise PlanError(f"cannot load the model: {e}", 4) from e
    try:
        tokenizer = load_tokenizer(path)
    except (ValueError, OSError) as e:
        raise PlanError(f"cannot load the model's tokenizer: {e}", 4) from e
    return tokenizer, cfg, path


def describe_weights(cfg: ModelConfig, path: Path, gguf: bool) -> str:
    """The weights' format and the checkpoint's size on disk (no weight is read)."""
    fmt = cfg.quantization.describe() if cfg.quantization is not None else "plain"
    fmt += describe_experts(cfg)
    if gguf:
        return f"{fmt} (converted from GGUF)"
    files = list(path.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    dtype = f", {cfg.torch_dtype}" if cfg.quantization is None and cfg.torch_dtype else ""
    return f"{fmt}{dtype}; {size / 1e9:.2f} GB in {len(files)} safetensors files"


def make_plan(dataset: str, **kw) -> str:
    """The plan's report. DATASET ``-``: standard input, spooled to a temporary file."""
    if dataset != STDIN:
        return _make_plan(dataset, dataset, **kw)
    with tempfile.TemporaryDirectory(prefix="batchrun-plan-") as tmp:
        path = spool_stdin(sys.stdin.buffer, Path(tmp)).keep()
        return _make_plan(str(path), "standard input", **kw)


def _make_plan(
    dataset: str,
    name: str,
    *,
    model: str | None,
    quantization: str | None = None,
    split: str | None,
    spec: RowSpec,
    defaults: SamplingParams,
    limit: int | None,
    kv_budget: int | None,
    max_running: int | None,
    max_model_len: int | None = None,
    kv_cache_dtype: str = "auto",
    linear_state_dtype: str = "float32",
    device: str = "auto",
    dtype: str = "auto",
    show_errors: int = 10,
    order: str = "prefix",
    order_window: int = DEFAULT_WINDOW,
    served_model_name: str | None = None,
) -> str:
    try:
        source = open_dataset(dataset, split)
    except BadInputError as e:
        raise PlanError(str(e), 3) from e
    problem = schema_problem(source.columns, spec)
    if problem is not None:  # submit refuses it too (exit 3)
        raise PlanError(f"{dataset}: {problem}", 3)
    tokenizer, cfg, model_path = load_tokenizer_and_context(model, quantization)
    try:
        context_len = served_context_len(max_model_len, cfg)
    except ModelConfigError as e:
        raise PlanError(str(e), 2) from e
    is_gguf = model is None or model.endswith(".gguf")
    if max_running is None:  # the engine's default on this machine
        max_running = resolve_sizes(EngineConfig(device=device), cfg).max_running
    kv = KVElement.of(kv_cache_dtype, dtype, device)
    pipeline = RowPipeline(
        source,
        spec,
        defaults,
        tokenizer,
        context_len,
        limit,
        vocab_size=cfg.vocab_size,
    )
    prompt_lens: list[int] = []
    max_new: list[int] = []
    samples = 0
    errors: Counter[str] = Counter()
    examples: list[RowError] = []
    reuse = PrefixReuse(kv_budget, order, hybrid=cfg.linear_attention is not None)
    for item in pipeline:
        if isinstance(item, RowError):
            errors[item.type] += 1
            if len(examples) < show_errors:
                examples.append(item)
            continue
        prompt_lens.append(len(item.input_ids))
        max_new.append(item.prepared.params.max_new_tokens)
        samples += item.prepared.params.n
        reuse.add(item.input_ids, item.prepared.params.max_new_tokens)
        if reuse.num_buffered >= order_window:
            reuse.flush()
    reuse.flush()
    rows = len(prompt_lens) + sum(errors.values())
    if rows == 0:
        raise PlanError(f"{name}: the input has no rows; nothing to do", 3)
    served = ""
    if pipeline.openai:
        served = (
            f"; OpenAI output names it {served_model_name or default_served_model_name(model)!r}"
        )
    lines = [
        f"dataset      {name} ({source.format}{', OpenAI batch' if pipeline.openai else ''})",
        f"model        {model or 'embedded SmolLM2-135M-Instruct'} "
        f"(context {_context(context_len, cfg)}{served})",
        f"weights      {describe_weights(cfg, model_path, is_gguf)}",
        f"parameters   {describe_params(cfg)}",
        f"rows         {rows}: {len(prompt_lens)} would run, {sum(errors.values())} would fail",
    ]
    if prompt_lens:
        p = np.array(prompt_lens, dtype=np.int64)
        m = np.array(max_new, dtype=np.int64)
        need = np.sort(p + m)[::-1]
        peak = int(need[:max_running].sum())
        lines += [
            f"prompt tok   total {int(p.sum()):,}  min {p.min()}  mean {p.mean():.1f}  "
            f"p50 {int(np.percentile(p, 50))}  p95 {int(np.percentile(p, 95))}  max {p.max()}",
            f"max new tok  total {int(m.sum()):,} over {samples} completions "
            f"(mean {m.mean():.1f} per row)",
            f"KV need      {int(need[0]):,} tokens for the longest request; {peak:,} tokens to "
            f"run {min(max_running, len(need))} of the longest at once (--max-running "
            f"{max_running})",
            kv_bytes_line(cfg, kv, int(need[0]), peak),
        ]
        if uses_window_pool(cfg, cfg.linear_attention is not None):
            lines.append(window_bytes_line(cfg, kv, int(need[0]), peak, max_running))
        if cfg.linear_attention is not None:  # a hybrid's recurrent states (docs/hybrid.md)
            state = cfg.linear_attention.state_bytes(1, linear_state_dtype)
            snaps = num_snapshots(max_running)
            lines += [
                f"state bytes  {gb(state)} a request ({linear_state_dtype}, its linear-attention "
                "layers), "
                f"{gb(state * (max_running + 1))} for --max-running {max_running}, taken from "
                "the memory budget before the KV pool",
                f"snapshots    {snaps} state snapshots for the prefix cache, {gb(state * snaps)},"
                " taken from the memory budget with the states",
            ]
        if kv_budget is not None:
            verdict = (
                "fits"
                if peak <= kv_budget
                else (
                    "runs, with fewer requests at once"
                    if need[0] <= kv_budget
                    else "TOO SMALL for the longest request"
                )
            )
            pool = gb(kv_budget * kv.bytes_per_token(cfg))
            lines.append(f"KV budget    {kv_budget:,} tokens ({pool}): {verdict}")
        lines += reuse.report(order_window)
    repeats = errors["duplicate_id"]
    if repeats and pipeline.openai:
        lines.append(
            f"duplicates   {repeats:,} requests repeat an earlier custom_id: submit refuses this "
            "OpenAI Batch file (exit 3) until every custom_id is unique"
        )
    elif repeats:
        lines.append(
            f"duplicates   {repeats:,} rows repeat an earlier row's id: they would fail as "
            "duplicate_id (the first row with an id runs)"
        )
    if errors:
        lines.append("would fail   " + ", ".join(f"{k}: {v}" for k, v in errors.most_common()))
        for e in examples:
            lines.append(f"  row {e.row} (id {e.id}): {e.type}: {e.message}")
    return "\n".join(lines)


def _context(context_len: int, cfg: ModelConfig) -> str:
    if context_len == cfg.max_position_embeddings:
        return f"{context_len:,}"
    return f"{context_len:,}, --max-model-len; the model's {cfg.max_position_embeddings:,}"


class PrefixReuse:
    """Prefix-cache reuse of a run, window by window as the run orders it (batchrun.job.order)."""

    def __init__(self, kv_budget: int | None, order: str, hybrid: bool = False):
        """hybrid: a hybrid model's cache, whose hits end at state snapshots
        (order.snapshot_reuse_lens)."""
        self.order = order
        self.hybrid = hybrid
        self.sim = LRUEstimate(kv_budget) if kv_budget is not None else None
        self.prompt_tokens = 0
        self.unlimited = 0  # exact within each window
        self.block_unlimited = 0  # the same in whole blocks of the simulation
        self.num_windows = 0
        self._keys: list[bytes] = []
        self._max_new: list[int] = []

    @property
    def num_buffered(self) -> int:
        return len(self._keys)

    def add(self, ids: list[int], max_new: int) -> None:
        self._keys.append(sort_key(ids))
        self._max_new.append(max_new)

    def flush(self) -> None:
        if not self._keys:
            return
        keys, self._keys = self._keys, []
        max_new, self._max_new = self._max_new, []
        dfs = dfs_order(keys)
        sorted_keys = [keys[i] for i in dfs]
        reuse = reuse_lens(sorted_keys)  # what the LRU simulation's blocks are measured against
        exact = reuse
        if self.hybrid:
            exact = snapshot_reuse_lens(sorted_keys, SNAPSHOT_LOOKAHEAD, MIN_SNAPSHOT_PREFIX)
        self.num_windows += 1
        self.prompt_tokens += sum(len(k) for k in keys) // 4
        self.unlimited += int(exact.sum())
        if self.sim is not None:
            block = self.sim.block
            self.block_unlimited += int((reuse // block * block).sum())
            run_order = dfs if self.order == "prefix" else range(len(keys))
            for i in run_order:
                self.sim.feed(keys[i], max_new[i])

    def report(self, window: int) -> list[str]:
        total = max(self.prompt_tokens, 1)
        scope = (
            "exact"
            if self.num_windows <= 1
            else f"exact within each of {self.num_windows} windows of {window:,} rows; reuse "
            "across windows not counted"
        )
        where = ""
        if self.hybrid:  # snapshot_reuse_lens follows the DFS order's neighbours
            where = "; at state-snapshot boundaries (hybrid)"
            if self.order != "prefix":
                where += ", as --order prefix runs; --order input hits less"
        lines = [
            f"prefix reuse unlimited cache: {self.unlimited / total:.3f} of prompt tokens "
            f"({self.unlimited:,} of {self.prompt_tokens:,}; {scope}{where})"
        ]
        if self.sim is not None:
            predicted = predicted_reuse(self.unlimited, self.sim.hits, self.block_unlimited)
            lines.append(
                f"             --kv-budget {self.sim.capacity:,}, --order {self.order}: "
                f"~{predicted / total:.3f} predicted (approximation: LRU over "
                f"{self.sim.block}-token blocks of the prompts in run order, outputs cached too; "
                "requests running at once not modelled)"
            )
        return lines
