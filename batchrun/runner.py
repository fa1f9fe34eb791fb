"""`batchrun submit`: dataset in, sharded JSONL out.

    read (batches of raw rows) -> prepare (id, prompt/messages, per-row params) -> tokenize
    -> prefix order (DFS over token ids, per window of --order-window rows)
    -> engine.generate (lazily pulled, bounded) -> group the n samples of a row -> records
    -> ShardedWriter (results / errors) -> manifest.json

Every input row ends up exactly once: in a results shard (n lines) or in an errors shard.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec

from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.params import GenerateRequest, GenerateResult, SamplingParams
from batchrun.engine.stop import cut_at_stop
from batchrun.io.manifest import Counts, InputInfo, Manifest, read_manifest, utc_now, write_manifest
from batchrun.io.readers import DatasetSource, open_dataset
from batchrun.io.records import (
    Completion,
    encode_line,
    error_record,
    openai_error_record,
    openai_result_record,
    result_records,
)
from batchrun.io.rows import PreparedRow, RowError, RowSpec
from batchrun.io.writer import ShardedWriter
from batchrun.order import DEFAULT_WINDOW, ORDERS, ordered_windows
from batchrun.pipeline import RowPipeline
from batchrun.progress import Progress
from batchrun.tokenize import TokenizedRow


class RunError(Exception):
    """A run that cannot start or go on; the message says what to do."""

    exit_code = 1


class InputError(RunError):
    exit_code = 3


@dataclass(frozen=True)
class RunConfig:
    dataset: str
    out: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    defaults: SamplingParams = SamplingParams()
    spec: RowSpec = field(default_factory=RowSpec)
    split: str | None = None
    limit: int | None = None
    shard_size: int = 10_000
    with_token_ids: bool = False
    overwrite: bool = False
    quiet: bool = False
    read_batch_size: int = 256
    order: str = "prefix"  # prefix: DFS order over token ids per window; input: as read
    order_window: int = DEFAULT_WINDOW  # rows ordered together (held in memory at once)

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}; got {self.order!r}")
        if self.order_window < 1:
            raise ValueError(f"order_window must be >= 1; got {self.order_window}")


@dataclass
class RunSummary:
    rows: int = 0
    rows_ok: int = 0
    rows_failed: int = 0
    completions: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    elapsed_s: float = 0.0

    @property
    def cached_fraction(self) -> float:
        """Prompt tokens served from the prefix cache, as a fraction of all prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def line(self) -> str:
        tok_s = self.completion_tokens / self.elapsed_s if self.elapsed_s else 0.0
        return (
            f"{self.rows} rows: {self.rows_ok} ok, {self.rows_failed} failed; "
            f"{self.completion_tokens} output tokens in {self.elapsed_s:.1f} s "
            f"({tok_s:,.0f} tok/s); cached_fraction {self.cached_fraction:.3f} "
            f"({self.cached_tokens:,} of {self.prompt_tokens:,} prompt tokens)"
        )


class Runner:
    def __init__(self, config: RunConfig, engine: Engine | None = None):
        self.config = config
        self.out = Path(config.out)
        self.source = self._open_source()
        self._prepare_out_dir()
        self.engine = engine or Engine(config.engine)
        self.tokenizer = self.engine.tokenizer
        self.summary = RunSummary()
        self._pipeline: RowPipeline | None = None
        self._pending: dict[str, tuple[PreparedRow, list[Completion]]] = {}
        self._failures: dict[str, str] = {}  # rid -> why the engine could not run it
        self._results = ShardedWriter(self.out, "results", config.shard_size)
        self._errors = ShardedWriter(self.out, "errors", config.shard_size)
        self._manifest = Manifest(
            created=utc_now(),
            model=config.engine.model or "embedded:SmolLM2-135M-Instruct",
            input=InputInfo(str(config.dataset), self.source.format, config.split),
            config=self._config_dict(),
        )

    # -- set-up ------------------------------------------------------------------------------

    def _open_source(self) -> DatasetSource:
        from batchrun.io.readers import BadInputError

        try:
            return open_dataset(self.config.dataset, self.config.split)
        except BadInputError as e:
            raise InputError(str(e)) from e

    def _prepare_out_dir(self) -> None:
        out = self.out
        if out.exists() and not out.is_dir():
            raise RunError(f"--out {out} exists and is not a directory")
        if out.is_dir() and any(out.iterdir()):
            if not self.config.overwrite:
                state = "a batchrun run" if read_manifest(out) is not None else "files"
                raise RunError(
                    f"--out {out} already holds {state}; choose another directory or pass "
                    "--overwrite to replace it"
                )
            for p in out.iterdir():
                if p.is_file() and (
                    p.name == "manifest.json"
                    or p.suffix == ".jsonl"
                    or p.name.endswith(".jsonl.tmp")
                ):
                    p.unlink()
        out.mkdir(parents=True, exist_ok=True)

    def _config_dict(self) -> dict:
        cfg = self.config
        return {
            "dataset": str(cfg.dataset),
            "split": cfg.split,
            "limit": cfg.limit,
            "shard_size": cfg.shard_size,
            "order": cfg.order,
            "order_window": cfg.order_window,
            "spec": asdict(cfg.spec),
            "defaults": msgspec.to_builtins(cfg.defaults),
            "engine": asdict(cfg.engine),
        }

    def total_rows(self) -> int | None:
        n = self.source.num_rows
        if n is None and hasattr(self.source, "count_rows"):
            n = self.source.count_rows()
        if n is not None and self.config.limit is not None:
            n = min(n, self.config.limit)
        return n

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> RunSummary:
        total = self.total_rows()
        if total == 0:
            raise InputError(f"{self.config.dataset}: the input has no rows; nothing to do")
        write_manifest(self.out, self._manifest)
        progress = Progress(total, self.config.quiet)
        start = time.perf_counter()
        try:
            for result in self.engine.generate(self._requests()):
                self._on_result(result, progress)
            self._results.close()
            self._errors.close()
        finally:
            progress.close()
        s = self.summary
        s.elapsed_s = time.perf_counter() - start
        if self._pending:
            raise RunError(f"internal error: {len(self._pending)} rows never finished")
        self._manifest.status = "complete"
        self._manifest.finished = utc_now()
        self._commit_manifest()
        return s

    def _requests(self) -> Iterator[GenerateRequest]:
        cfg = self.config
        self._pipeline = RowPipeline(
            self.source,
            cfg.spec,
            cfg.defaults,
            self.tokenizer,
            self.engine.context_len,
            cfg.limit,
            cfg.read_batch_size,
        )
        rows: Iterator[TokenizedRow] = self._tokenized(self._pipeline)
        if cfg.order == "prefix":
            # requests sharing a prefix run back to back, so the radix cache computes it once
            rows = ordered_windows(rows, _input_ids, cfg.order_window)
        for item in rows:
            yield self._request(item)

    def _tokenized(self, pipeline: RowPipeline) -> Iterator[TokenizedRow]:
        for item in pipeline:
            if isinstance(item, RowError):
                self._on_error(item)
            else:
                yield item

    def _request(self, item: TokenizedRow) -> GenerateRequest:
        prepared = item.prepared
        rid = str(prepared.row)  # unique even when user ids repeat
        self._pending[rid] = (prepared, [])
        params = prepared.params
        if params.seed is None:
            # per-row seed from the row's id: a row samples the same wherever it runs
            from batchrun.engine.engine import derive_seed

            params = msgspec.structs.replace(
                params, seed=derive_seed(self.config.engine.seed, prepared.id)
            )
        return GenerateRequest(rid, item.input_ids, params)

    # -- results -----------------------------------------------------------------------------

    def _on_result(self, result: GenerateResult, progress: Progress) -> None:
        prepared, done = self._pending[result.rid]
        done.append(self._completion(prepared, result))
        if result.error:
            self._failures[result.rid] = result.error
        if len(done) < prepared.params.n:
            return
        del self._pending[result.rid]
        failure = self._failures.pop(result.rid, None)
        if failure is not None:
            self._on_error(RowError(prepared.id, prepared.row, "engine_error", failure))
        else:
            self._write_results(prepared, done)
        s = self.summary
        progress.update(1, s.completion_tokens, s.prompt_tokens, s.cached_tokens)

    def _write_results(self, prepared: PreparedRow, done: list[Completion]) -> None:
        s = self.summary
        s.rows += 1
        s.rows_ok += 1
        s.completions += len(done)
        s.prompt_tokens += sum(c.prompt_tokens for c in done)
        s.cached_tokens += sum(c.cached_tokens for c in done)
        s.completion_tokens += sum(c.completion_tokens for c in done)
        if prepared.openai:
            token_str = (lambda t: self.tokenizer.decode([t])) if prepared.params.logprobs else None
            record = openai_result_record(
                prepared,
                done,
                model=prepared.extra.get("model") or self._manifest.model,
                token_str=token_str,
            )
            self._commit(self._results.add(encode_line(record)))
            return
        for record in result_records(
            prepared, done, with_token_ids=self.config.with_token_ids, with_timing=False
        ):
            self._commit(self._results.add(encode_line(record)))

    def _completion(self, prepared: PreparedRow, r: GenerateResult) -> Completion:
        text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
        if r.finish_reason == "stop" and isinstance(r.matched_stop, str):
            text = cut_at_stop(text, prepared.params.stop, matched=r.matched_stop)
        return Completion(
            index=r.index,
            text=text,
            token_ids=r.output_ids,
            finish_reason=r.finish_reason,
            prompt_tokens=r.prompt_tokens,
            completion_tokens=r.completion_tokens,
            cached_tokens=r.cached_tokens,
            logprobs=r.logprobs,
            top_logprobs=r.top_logprobs,
        )

    def _on_error(self, error: RowError) -> None:
        self.summary.rows += 1
        self.summary.rows_failed += 1
        openai = self._pipeline is not None and self._pipeline.openai
        record = openai_error_record(error) if openai else error_record(error)
        self._commit(self._errors.add(encode_line(record)))

    def _commit(self, shard) -> None:
        """A shard was just written: list it in the manifest (the commit record)."""
        if shard is not None:
            self._commit_manifest()

    def _commit_manifest(self) -> None:
        s = self.summary
        m = self._manifest
        m.files = list(self._results.files) + list(self._errors.files)
        m.counts = Counts(
            rows_total=s.rows,
            rows_ok=s.rows_ok,
            rows_failed=s.rows_failed,
            completions=s.completions,
            prompt_tokens=s.prompt_tokens,
            completion_tokens=s.completion_tokens,
            cached_tokens=s.cached_tokens,
        )
        write_manifest(self.out, m)


def _input_ids(row: TokenizedRow) -> list[int]:
    return row.input_ids


def default_out_dir(dataset: str) -> str:
    stem = Path(dataset).name.split(".")[0] or "run"
    return os.path.join("runs", stem)
