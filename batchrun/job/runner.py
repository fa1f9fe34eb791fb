"""`batchrun submit`: dataset in, sharded JSONL out, resumable.

    read (batches of raw rows) -> prepare (id, prompt/messages, per-row params) -> tokenize
    -> keep this shard's rows, skip rows committed by an earlier attempt
    -> prefix order (DFS over token ids, per window of --order-window rows)
    -> engine (fed lazily, stepped by the runner's loop) -> group the n samples of a row
    -> records -> RunOutput (results / errors shards, row ledger; manifest.json = the commit)

Every input row ends up exactly once: in a results shard (n lines) or in an errors shard. The
loop is ``while not done: step()``; it commits every --commit-every rows or --commit-interval
seconds, and on SIGTERM / SIGINT / SIGUSR1 stops feeding the engine, drains the rows in flight
for at most --drain-timeout seconds, commits and reports ``interrupted`` (exit code 5).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import msgspec

from batchrun.engine.engine import Engine, derive_seed
from batchrun.engine_process.client import EngineProcess, EngineProcessError
from batchrun.engine_process.data_parallel import DataParallelEngine, device_indices
from batchrun.engine_process.tp_launcher import start_tp_engine
from batchrun.errors import InputError, ModelError, RunError
from batchrun.io.manifest import InputInfo, Manifest, utc_now
from batchrun.io.readers import BadInputError
from batchrun.io.records import Completion
from batchrun.io.rows import PreparedRow, RowError
from batchrun.job.commit import RunOutput
from batchrun.job.config import RunConfig
from batchrun.job.model_check import check_model
from batchrun.job.order import ordered_windows, shard_of
from batchrun.job.pipeline import RowPipeline, openai_duplicates
from batchrun.job.resume import make_fingerprint
from batchrun.job.row_sink import RowSink
from batchrun.job.run_input import RunInput, no_column_warning
from batchrun.job.run_lock import RunLock
from batchrun.job.shards import error_shard_of, shard_dir
from batchrun.job.signals import EXIT_INTERRUPTED, StopSignals
from batchrun.job.summary import RunSummary
from batchrun.job.tokenize import TokenizedRow
from batchrun.params import EngineCounters, GenerateRequest, GenerateResult
from batchrun.pooling.job_engine import PoolingJobEngine, PoolJobRequest
from batchrun.pooling.job_rows import PoolingRows
from batchrun.pooling.job_sink import PoolingSink
from batchrun.progress.bar import Progress

if TYPE_CHECKING:
    from batchrun.progress.hub import ProgressHub

__all__ = ["InputError", "ModelError", "RunError", "RunSummary", "Runner"]


class Runner:
    def __init__(
        self,
        config: RunConfig,
        engine: Engine | None = None,
        hub: ProgressHub | None = None,
        stdin: BinaryIO | None = None,
    ):
        self.config = config
        self.hub = hub  # --serve-progress: gets counts and encoded rows; never blocks the loop
        self.out = shard_dir(config.out, config.num_shards, config.shard_index)
        # DATASET "-": the rows are read from `stdin` (default: this process's standard input)
        self.input = RunInput(config.dataset, config.split, self.out, stdin)
        self.source = self.input.source
        self._lock: RunLock | None = None
        try:
            # refused before --out is touched and the model loads
            if self._input_is_empty():
                raise InputError(f"{self.input.name}: the input has no rows; nothing to do")
            self.input.check_columns(config.spec)
            self._refuse_repeated_custom_ids()
            # before --out is made and the tokenizer loads (a pooling task's model: its loader)
            if engine is None and config.pooling is None:
                check_model(config.engine)
            self.warnings = self.input.check_keep_columns(config.spec.keep_columns)
            fresh = Manifest(
                created=utc_now(),
                model=config.engine.model or "embedded:SmolLM2-135M-Instruct",
                input=InputInfo(self.input.path, self.input.source.format, config.split),
                config=self._config_dict(),
                num_shards=config.num_shards,
                shard_index=config.shard_index,
                fingerprint=self._fingerprint(),
            )
            # the lock first: a resume repairs files, which no other process may be writing
            self._lock = RunLock.acquire(self.out)
            self.output = RunOutput.open(self.out, fresh, config.shard_size, config.overwrite)
        except BaseException:
            self.input.discard()
            self._release_lock()
            raise
        self.source = self.input.accept()
        self._manifest = self.output.manifest
        self.summary = RunSummary.from_counts(self._manifest.counts)
        self.engine: Engine | EngineProcess | DataParallelEngine | None = None
        self._owns_engine = engine is None
        self.summary.error_files = self._error_files()
        if self.output.is_complete:
            self.summary.status = "already complete"
            self._release_lock()
            return
        self._lock.record()
        # NOTE: handlers go in before the (slow) model load, so a Slurm signal that comes while
        # loading still ends in a commit and exit 5; run() restores the previous ones.
        self._stop = StopSignals(config.handle_signals, config.drain_timeout).install()
        try:
            self.engine = engine or self._start_engine()
            self.tokenizer = self.engine.tokenizer
            if config.pooling is None:
                self.sink = RowSink(config, self.output, self.summary, self.tokenizer, hub)
            else:
                labels = self.engine.model.labels
                self.sink = PoolingSink(
                    config.pooling, labels, self.output, self.summary, hub, config.model_name
                )
                self.output.embedding_dtype = config.pooling.embedding_dtype
            self._manifest.kernels = asdict(self.engine.kernels)
        except BaseException:
            self._stop.restore()
            self._release_lock()
            raise
        self._pipeline: RowPipeline | None = None
        self.progress = Progress(None, quiet=True)  # run() makes the real one
        self._base_counters = EngineCounters()
        self._pending: dict[str, tuple[PreparedRow, list[Completion]]] = {}
        self._failures: dict[str, str] = {}  # rid -> why the engine could not run it

    # -- set-up ------------------------------------------------------------------------------

    def _start_engine(self) -> Engine | EngineProcess | DataParallelEngine:
        cfg = self.config
        if cfg.pooling is not None:  # prefill-only tasks: in this process, one device
            return PoolingJobEngine(cfg.engine, cfg.pooling)
        if not cfg.engine_process:
            if cfg.engine.tp_size > 1:
                return start_tp_engine(cfg.engine, cfg.engine.tp_size)
            return Engine(cfg.engine)
        indices = device_indices(cfg.engine, cfg.dp)
        if cfg.dp > 1:
            return DataParallelEngine(
                cfg.engine, cfg.dp, notify_batch=cfg.notify_batch, device_indices=indices
            )
        return EngineProcess(cfg.engine, notify_batch=cfg.notify_batch, device_index=indices[0])

    def request_stop(self, reason: str = "stop") -> None:
        """Stop as a first stop signal does (drain, commit, status interrupted); from any
        thread, for code that runs the runner off the main thread (batchrun serve)."""
        self._stop.request(reason)

    def close(self) -> None:
        """Stop the engine processes this runner started (run() does it; idempotent)."""
        close = getattr(self.engine, "close", None)  # engine processes, tensor-parallel ranks
        if self._owns_engine and close is not None:
            close()
        self._release_lock()

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def _refuse_repeated_custom_ids(self) -> None:
        """OpenAI Batch input that gives a custom_id twice is refused whole, before the model
        loads and before --out is touched, as the service refuses it (other inputs: one batch
        is read to know)."""
        try:
            found = openai_duplicates(self.source, self.config.limit)
        except BadInputError as e:
            raise InputError(str(e)) from e
        if found is not None:
            raise InputError(found.message(self.input.name))

    def _input_is_empty(self) -> bool:
        """Whether the input holds no row at all (a pass only up to its first row)."""
        if self.source.num_rows is not None:
            return self.source.num_rows == 0
        batches = self.source.iter_batches(1)
        try:
            return next(batches, None) is None
        except BadInputError as e:
            raise InputError(str(e)) from e
        finally:
            batches.close()

    def _error_files(self) -> list[str]:
        return [f.path for f in self.output.errors.files]

    def _fingerprint(self) -> dict:
        try:
            return make_fingerprint(self.config, self.input.source.format, self.input.identity)
        except OSError as e:
            raise InputError(f"cannot read {self.config.dataset} or the model: {e}") from e

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
            "served_model_name": cfg.model_name,
            **({"task": asdict(cfg.pooling)} if cfg.pooling is not None else {}),
        }

    @property
    def repairs(self) -> list[str]:
        """What resuming had to repair (uncommitted tails dropped, stray files removed)."""
        return self.output.notes

    def total_rows(self) -> int | None:
        n = self.source.num_rows
        if n is None and hasattr(self.source, "count_rows"):
            n = self.source.count_rows()
        if n is not None and self.config.limit is not None:
            n = min(n, self.config.limit)
        return n

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> RunSummary:
        if self.engine is None:  # already complete: nothing to do
            return self.summary
        try:
            return self._run()
        finally:
            self.close()  # the engine process goes, however the run ended

    def _run(self) -> RunSummary:
        cfg = self.config
        try:
            total = self.total_rows()
        except BadInputError as e:  # a CSV record or JSON array that does not parse
            self._stop.restore()
            raise InputError(str(e)) from e
        self._commit(status="running")  # a fresh run's manifest exists before any shard
        self.progress = progress = Progress(total if cfg.num_shards == 1 else None, cfg.quiet)
        self.sink.progress = progress
        s = self.summary
        progress.rows(s.rows)
        # the engine's counts are cumulative since it started: this attempt's start from here
        self._base_counters = self.engine.counters
        if self.hub is not None:
            shard = (cfg.shard_index, cfg.num_shards) if cfg.num_shards > 1 else None
            self.hub.start(total if cfg.num_shards == 1 else None, s, shard)
        start = time.perf_counter()
        self._requests_iter = self._requests()
        self._exhausted = False
        stop = self._stop
        exit_code = 1  # what a signal after the run means, if the run raises
        try:
            try:
                while not self._done():
                    self._step()
            except EngineProcessError:
                # the engine process died: the rows that did finish are complete; commit
                # them, so the out directory is consistent and a resume redoes only the rest
                self._commit(status="failed")
                raise
            interrupted = stop.requested and not (self._exhausted and not self._pending)
            progress.close()
            s.elapsed_s = time.perf_counter() - start
            # NOTE: the handlers stay in place through the final commit: a second signal there
            # exits at once, and the manifest (replaced atomically) stays consistent
            if interrupted:
                s.status = "interrupted"
                self._commit(status="interrupted")
                exit_code = EXIT_INTERRUPTED
            else:
                if self._pending:
                    raise RunError(f"internal error: {len(self._pending)} rows never finished")
                s.status = "complete"
                self._commit(status="complete", finished=utc_now())
                exit_code = 0
                if self.source.columns is None:  # JSON rows: a kept column no row had
                    unseen = sorted(self._pipeline.unseen_columns) if self._pipeline else []
                    self.warnings += [no_column_warning(c, None) for c in unseen]
            if isinstance(self._pipeline, PoolingRows) and self._pipeline.num_truncated:
                self.warnings.append(self._pipeline.truncation_note())
            if isinstance(self.engine, PoolingJobEngine):
                s.notes = self.engine.notes(self._base_counters, self._pipeline, s.elapsed_s)
        finally:
            progress.close()
            self._requests_iter.close()
            if self.hub is not None:
                self.hub.update(s)
                self._report_engine()
                self.hub.finish(s.status if s.status != "running" else "failed")
            if cfg.keep_signal_handlers:
                # a process about to exit: a late signal (e.g. Slurm's USR1 just after the drain)
                # must not kill it with the default action, but exit with the run's own code
                stop.finish(exit_code)
            else:
                stop.restore()
        self.output.close()
        s.error_files = self._error_files()
        return s

    def _done(self) -> bool:
        engine, stop = self.engine, self._stop
        if stop.requested:
            # NOTE: stop admitting: requests that never started leave the queue. Their rows stay
            # uncommitted and run on resume; only the running ones drain.
            engine.drop_waiting()
            # drain: the running rows finish, unless the timeout passes first
            return not engine.has_work or stop.drain_expired
        return self._exhausted and not engine.has_work

    def _step(self) -> None:
        """Feed the engine (bounded, as Engine.generate does), run one step, commit if due."""
        engine = self.engine
        while not self._exhausted and not self._stop.requested and engine.wants_requests:
            request = next(self._requests_iter, None)
            if request is None:
                self._exhausted = True
                continue
            try:
                engine.add_request(request)
            except ValueError as e:  # the engine refuses it (the engine process reports these)
                prepared, _ = self._pending.pop(request.rid)
                self._on_error(
                    RowError(prepared.id, prepared.row, "engine_error", str(e), prepared.kept)
                )
        if engine.has_work:
            for result in engine.step():
                self._on_result(result)
            self._report_engine()
        cfg = self.config
        pending = self.output.num_uncommitted
        if pending >= cfg.commit_every or (
            pending and time.monotonic() - self.output.last_commit >= cfg.commit_interval
        ):
            self._commit()

    def _report_engine(self) -> None:
        """The engines' counters (tokens generated so far, requests, KV use) to the bar and the
        hub: a few ints and one short lock per step, never per token."""
        engine = self.engine
        counters = engine.counters.since(self._base_counters)
        self.progress.tokens(counters, self.summary)
        if self.hub is not None:
            per_engine = ()
            if isinstance(engine, DataParallelEngine):
                per_engine = tuple(engine.counters_per_engine)
            self.hub.update_engine(counters, per_engine)

    def _commit(self, status: str | None = None, finished: str | None = None) -> None:
        self.output.commit(self.summary.counts(), status, finished)

    def _requests(self) -> Iterator[GenerateRequest | PoolJobRequest]:
        cfg = self.config
        if cfg.pooling is not None:
            yield from self._pool_requests()
            return
        self._pipeline = RowPipeline(
            self.source,
            cfg.spec,
            cfg.defaults,
            self.tokenizer,
            self.engine.context_len,
            cfg.limit,
            cfg.read_batch_size,
            vocab_size=self.engine.vocab_size,
        )
        rows: Iterator[TokenizedRow] = self._tokenized(self._pipeline)
        if cfg.order == "prefix":
            # requests sharing a prefix run back to back, so the radix cache computes it once
            rows = ordered_windows(rows, _input_ids, cfg.order_window)
        for item in rows:
            yield self._request(item)

    def _pool_requests(self) -> Iterator[PoolJobRequest]:
        """A pooling task's rows (pooling/job_rows.py) as the engine's requests, through the same
        shard / resume filter as generate's."""
        cfg = self.config
        rows = PoolingRows(self.source, cfg.spec, cfg.pooling, self.engine.model, cfg.limit,
                           cfg.read_batch_size, self.engine.model_dir,
                           self.engine.tokenizer_pool)  # fmt: skip
        self._pipeline = rows  # its `openai` decides the errors' shape
        # NOTE: input order (--order is generate's): no radix cache to feed, a step shares what
        # consecutive rows share, and a window held for ordering would stall the engine while
        # the tokenizer workers fill it (docs/pooling.md, "The job")
        for item in self._tokenized(rows):
            rid = str(item.prepared.row)
            self._pending[rid] = (item.prepared, [])
            yield PoolJobRequest(rid, item.token_rows)

    def _tokenized(self, pipeline: RowPipeline | PoolingRows) -> Iterator[TokenizedRow]:
        """This shard's rows that no earlier attempt committed (bad rows go to errors here)."""
        num_shards, index = self.config.num_shards, self.config.shard_index
        committed = self.output.is_committed
        for item in pipeline:
            if isinstance(item, RowError):
                if error_shard_of(item.row, num_shards) == index and not committed(item.row):
                    self._on_error(item)
            elif not committed(item.prepared.row) and (
                num_shards == 1 or shard_of(item.input_ids, num_shards) == index
            ):
                yield item

    def _request(self, item: TokenizedRow) -> GenerateRequest:
        prepared = item.prepared
        rid = str(prepared.row)  # unique even when user ids repeat
        self._pending[rid] = (prepared, [])
        params = prepared.params
        if params.seed is None:
            # per-row seed from the row's id: a row samples the same wherever it runs
            params = msgspec.structs.replace(
                params, seed=derive_seed(self.config.engine.seed, prepared.id)
            )
        return GenerateRequest(rid, item.input_ids, params)

    # -- results -----------------------------------------------------------------------------

    def _on_result(self, result: GenerateResult) -> None:
        """One sample of a row; the row is written once its n samples are in."""
        if self.config.pooling is not None:  # a pooled row: all of it at once
            prepared, _ = self._pending.pop(result.rid)
            self.sink.results(prepared, result)
            return
        prepared, done = self._pending[result.rid]
        done.append(self.sink.completion(prepared, result))
        if result.error:
            self._failures[result.rid] = result.error
        if len(done) < prepared.params.n:
            return
        del self._pending[result.rid]
        failure = self._failures.pop(result.rid, None)
        if failure is not None:
            self._on_error(
                RowError(prepared.id, prepared.row, "engine_error", failure, prepared.kept)
            )
            return
        self.sink.results(prepared, done)

    def _on_error(self, error: RowError) -> None:
        self.sink.error(error, openai=self._pipeline is not None and bool(self._pipeline.openai))


def _input_ids(row: TokenizedRow) -> list[int]:
    return row.input_ids


def default_out_dir(dataset: str) -> str:
    stem = Path(dataset).name.split(".")[0] or "run"
    return os.path.join("runs", stem)
