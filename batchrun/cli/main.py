"""The `batchrun` command line. Thin: options -> RunConfig -> Runner.run().

Exit codes:
    0  the run completed (rows that could not run are in errors-*.jsonl; at least one ran)
    1  the run failed (an engine or I/O error; the message says why)
    2  a bad option or argument (nothing was started)
    3  bad input: the dataset is missing, unreadable, empty or of an unknown format, or OpenAI
       Batch input repeats a custom_id (refused before the model loads)
    4  the model cannot be loaded (unsupported architecture, missing or mismatched weights)
    5  interrupted (SIGTERM, SIGINT or SIGUSR1): the committed rows are kept; resumable, run the
       same command again (Slurm: requeue the task)
    6  the run completed but no row could run: every row is in errors-*.jsonl (also a complete
       run submitted again, and a resumed one, when no row of the whole run ran)

`batchrun merge` exits 0 when every input row is in exactly one shard, 1 otherwise (the report
lists missing and duplicate ids), 3 when OUT or the input cannot be read. `batchrun inspect`
exits 0 when the files hold what the manifest committed, 1 when committed records are missing or
disagree with it, 3 when OUT is not a run directory.
`batchrun export` exits 0 when the file is written, 1 when OUT is damaged or the write fails, 2
for a bad option, 3 when OUT or its input cannot be read or the input changed since the run.
"""

from __future__ import annotations

import sys

import click

from batchrun import __version__
from batchrun.cli.build import (
    build_defaults,
    build_engine_config,
    build_pooling,
    build_spec,
    check_quantization,
    resolve_model,
)
from batchrun.cli.fresh_out import FreshOut
from batchrun.cli.options import (
    engine_options,
    model_options,
    output_options,
    plan_engine_options,
    plan_report_options,
    progress_options,
    row_options,
    run_control_options,
    sampling_options,
    structured_options,
    task_options,
    thinking_options,
)
from batchrun.cli.sections import SectionedCommand
from batchrun.errors import RunError
from batchrun.io.stdin import STDIN
from batchrun.job.config import RunConfig
from batchrun.job.inspect_run import InspectError, inspect_run
from batchrun.job.merge import MergeError, merge_run
from batchrun.job.shards import ShardOptionError, resolve_shards
from batchrun.serve.cli import serve

# NOTE: a module that loads torch, transformers, aiohttp or urllib (the runner, the engine
# processes, plan, the progress server and its client) is imported inside the command that needs
# it, so `batchrun --help`, `merge` and `inspect` start without them

EXIT_FAILED, EXIT_USAGE, EXIT_INPUT, EXIT_MODEL, EXIT_INTERRUPTED = 1, 2, 3, 4, 5
EXIT_ALL_FAILED = 6


def _fail(message: str, code: int) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="batchrun")
def main() -> None:
    """batchrun: offline batch LLM inference.

    \b
    batchrun submit prompts.jsonl --out runs/exp1            # embedded demo model, CPU
    batchrun submit data.parquet --model ~/models/Llama-3.1-8B-Instruct --out runs/exp2
    batchrun plan data.parquet --model ~/models/Llama-3.1-8B-Instruct
    batchrun inspect runs/exp1
    batchrun merge runs/exp3                                 # after a sharded (array) run
    batchrun export runs/exp1 --format parquet               # one file, input order, joined
    """


@main.command(cls=SectionedCommand)
@click.argument("dataset", type=click.Path())
@row_options
@sampling_options
@structured_options
@thinking_options
@model_options
@engine_options
@task_options
@output_options
@run_control_options
@progress_options
def submit(dataset: str, out: str, **o) -> None:
    """Run every row of DATASET through the model and write the completions to --out.

    DATASET: a .jsonl / .json (array or lines) / .csv / .tsv file (each optionally .gz), a
    .parquet file or directory, a HF `datasets` directory (save_to_disk), - for JSON Lines on
    standard input (spooled to OUT/stdin.jsonl), or an OpenAI Batch input file (results then
    follow the OpenAI Batch output format). Per-row fields (max_tokens, temperature, stop, seed,
    ...) override the options below; a prompt_token_ids column is a pre-tokenized prompt.

    Running the same command again resumes: committed rows are kept, the rest run (a run with
    different settings is refused unless --overwrite). With --num-shards N > 1 (default: from a
    Slurm array job) this process runs shard --shard-index of N into OUT/shard-I/; `batchrun
    merge OUT` checks and combines the shards.

    Exit codes: 0 done (bad rows are in errors-*.jsonl), 1 failed, 2 bad option, 3 bad input,
    4 model cannot be loaded, 5 interrupted by a signal (resumable: run the same command again),
    6 done but every row failed (all are in errors-*.jsonl).
    """
    try:
        num_shards, shard_index = resolve_shards(o["num_shards"], o["shard_index"])
    except ShardOptionError as e:
        raise click.UsageError(str(e)) from e
    _check_stdin(dataset)
    try:
        o["model"] = resolve_model(o)
        engine = build_engine_config(o)
    except RunError as e:
        _fail(str(e), e.exit_code)
    if o["dp"] > 1:
        from batchrun.engine_process.data_parallel import device_indices

        if not o["engine_process"]:
            raise click.UsageError("--dp runs engine processes; drop --in-process")
        try:
            device_indices(engine, o["dp"])
        except ValueError as e:
            raise click.UsageError(str(e)) from e

    config = RunConfig(
        dataset=dataset,
        out=out,
        engine=engine,
        defaults=build_defaults(o),
        spec=build_spec(o),
        split=o["split"],
        limit=o["limit"],
        shard_size=o["shard_size"],
        with_token_ids=o["with_token_ids"],
        overwrite=o["overwrite"],
        quiet=o["quiet"],
        order=o["order"],
        order_window=o["order_window"],
        commit_every=o["commit_every"],
        commit_interval=o["commit_interval"],
        drain_timeout=o["drain_timeout"],
        keep_signal_handlers=True,
        engine_process=o["engine_process"],
        notify_batch=o["notify_batch"],
        dp=o["dp"],
        served_model_name=o["served_model_name"],
        reasoning_parser=o["reasoning_parser"],
        tool_call_parser=o["tool_call_parser"],
        num_shards=num_shards,
        shard_index=shard_index,
        pooling=build_pooling(o),
    )
    server = _progress_server(o["serve_progress"], o["progress_token"])
    try:
        _submit(config, server)
    finally:
        if server is not None:
            server.stop()


def _check_stdin(dataset: str) -> None:
    if dataset == STDIN and click.get_text_stream("stdin").isatty():
        raise click.UsageError(
            "DATASET is - (rows on standard input) but standard input is a terminal; pipe the "
            "rows in, e.g. cat rows.jsonl | batchrun submit - --out DIR"
        )


def _progress_server(bind: str | None, token: str | None):
    """Bind before the model loads, so a bad address or a busy port fails at once."""
    if bind is None:
        return None
    from batchrun.progress.server import ProgressHub, ProgressServer, parse_bind

    try:
        host, port = parse_bind(bind)
        server = ProgressServer(ProgressHub(), host, port, token)
    except ValueError as e:
        raise click.UsageError(f"--serve-progress: {e}") from e
    try:
        server.start()
    except OSError as e:
        server.stop()
        raise click.UsageError(f"--serve-progress {bind}: cannot listen: {e}") from e
    click.echo(f"progress: {server.url}", err=True)
    return server


def _submit(config, server) -> None:
    from batchrun.job.runner import Runner

    fresh = FreshOut(config.out)
    try:
        try:
            runner = Runner(
                config,
                hub=server.hub if server is not None else None,
                stdin=click.get_binary_stream("stdin"),
            )
        except RunError as e:
            _fail(str(e), e.exit_code)
        except (ValueError, FileNotFoundError, OSError) as e:
            _fail(f"cannot load the model: {e}", EXIT_MODEL)
    except BaseException:
        fresh.discard_if_uncommitted()
        raise
    for warning in runner.warnings:
        click.echo(f"warning: {warning}", err=True)
    num_warned = len(runner.warnings)
    where = runner.out
    for note in runner.repairs:
        click.echo(f"resume: {note}", err=True)
    if runner.summary.already_complete:
        if server is not None:
            server.hub.start(runner.summary.rows, runner.summary)
            server.hub.finish(runner.summary.status)
        _report(
            runner.summary,
            where,
            f"{where} is already complete ({runner.summary.rows} rows); nothing to do "
            "(--overwrite runs it again)",
        )
        return
    if not config.quiet:
        click.echo(f"kernels: {runner.engine.kernels.describe()}", err=True)
    if runner.summary.resumed_rows:
        click.echo(
            f"resuming {where}: {runner.summary.resumed_rows} rows already committed", err=True
        )
    try:
        summary = runner.run()
    except RunError as e:
        _fail(str(e), e.exit_code)
    for warning in runner.warnings[num_warned:]:
        click.echo(f"warning: {warning}", err=True)
    if summary.interrupted:
        _report(
            summary,
            where,
            f"{summary.line()} -> {where}",
            "interrupted; resumable: run the same command again",
        )
        sys.exit(EXIT_INTERRUPTED)
    _report(summary, where, f"{summary.line()} -> {where}")


def _report(summary, where, head: str, tail: str | None = None) -> None:
    """The summary, then the errors by type and where they are; exit 6 when no row could run."""
    lines = [head, *summary.notes, summary.errors_line(where), tail]
    click.echo("\n".join(line for line in lines if line is not None), err=True)
    if summary.all_failed and not summary.interrupted:
        _fail(
            f"no row could run: all {summary.rows_failed:,} rows are in the errors file (the "
            "counts above say why); fix the input or the options and run again with --overwrite",
            EXIT_ALL_FAILED,
        )


@main.command(cls=SectionedCommand)
@click.argument("dataset", type=click.Path())
@row_options
@sampling_options
@model_options
@plan_engine_options
@plan_report_options
def plan(dataset: str, **o) -> None:
    """Dry run: read and tokenize DATASET, report rows, token statistics, rows that would fail
    and why, the KV cache the run needs, and the prompt tokens a prefix cache would reuse
    (unlimited, and predicted for --kv-budget). Loads the tokenizer only, not the weights."""
    from batchrun.job.plan import PlanError, make_plan

    _check_stdin(dataset)
    try:
        o["model"] = resolve_model(o)
    except RunError as e:
        _fail(str(e), e.exit_code)
    check_quantization(o)
    try:
        report = make_plan(
            dataset,
            model=o["model"],
            quantization=o["quantization"],
            split=o["split"],
            spec=build_spec(o),
            defaults=build_defaults(o),
            limit=o["limit"],
            kv_budget=o["kv_budget"],
            max_running=o["max_running"],
            max_model_len=o["max_model_len"],
            kv_cache_dtype=o["kv_cache_dtype"],
            linear_state_dtype=o["linear_state_dtype"],
            device=o["device"],
            dtype=o["dtype"],
            show_errors=o["show_errors"],
            order=o["order"],
            order_window=o["order_window"],
            served_model_name=o["served_model_name"],
        )
    except PlanError as e:
        _fail(str(e), e.exit_code)
    click.echo(report)


@main.command()
@click.argument("out", type=click.Path(file_okay=False))
@click.option(
    "--show", type=int, default=20, show_default=True, help="How many missing / duplicate ids."
)
def merge(out: str, show: int) -> None:
    """Check that every input row is in exactly one shard of OUT/shard-*/ and write the merged
    view OUT/merged/ (results-*.jsonl, errors-*.jsonl, manifest.json; hard links to the shard
    files). Exit 0 when complete and exactly once; 1 with a report of missing shards, missing ids
    and duplicate ids otherwise (nothing merged); 3 when OUT or the input cannot be read."""
    try:
        report = merge_run(out, show=show)
    except MergeError as e:
        _fail(str(e), EXIT_INPUT)
    click.echo(report.text())
    if not report.ok:
        sys.exit(EXIT_FAILED)


@main.command()
@click.argument("out", type=click.Path(file_okay=False))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["parquet", "jsonl"]),
    default=None,
    help="File format. Default: jsonl when --output ends in .jsonl, else parquet.",
)
@click.option(
    "--sort",
    type=click.Choice(["row", "none"]),
    default="row",
    show_default=True,
    help="row: input order (then sample index); none: the run's file order (needs --no-input).",
)
@click.option(
    "--input/--no-input",
    "with_input",
    default=True,
    show_default=True,
    help='Join each record with its whole input row, under "input" (re-reads the input the '
    "manifest names, checked against the run's fingerprint).",
)
@click.option(
    "--output",
    "-o",
    default=None,
    type=click.Path(dir_okay=False),
    help="The file to write. Default: OUT/export.parquet (or .jsonl).",
)
def export(out: str, fmt: str | None, sort: str, with_input: bool, output: str | None) -> None:
    """Write the records of the run in OUT (a run, a shard, or a sharded run's merged/) as one
    Parquet or JSONL file, in input order, each record with its input row joined; error records
    are rows whose "error" is set. Streams: memory holds a 28-byte index entry per record, never
    a whole file. Exit 0 when written, 1 when OUT is damaged, 2 for a bad option, 3 when OUT or
    its input cannot be read (or the input changed since the run)."""
    from batchrun.job.export import ExportError, export_run  # local: pyarrow

    try:
        report = export_run(out, fmt=fmt, sort=sort, with_input=with_input, output=output)
    except ExportError as e:
        _fail(str(e), e.exit_code)
    except OSError as e:
        _fail(f"cannot write the export: {e}", EXIT_FAILED)
    click.echo(report.text())


@main.command()
@click.argument("url")
@click.option("--token", default=None, envvar="BATCHRUN_PROGRESS_TOKEN", help="Progress token.")
@click.option("--rows", is_flag=True, help="Also print the finished rows (JSON lines, stdout).")
def tail(url: str, token: str | None, rows: bool) -> None:
    """Follow a run started with --serve-progress (URL: e.g. http://127.0.0.1:8765/) until it
    ends: snapshots on stderr (one updating line on a terminal), rows on stdout with --rows.
    Exit 0 at the run's end, 1 when the server cannot be reached or goes away, 130 on Ctrl-C."""
    from batchrun.progress.tail import TailError
    from batchrun.progress.tail import tail as follow

    try:
        follow(url, token=token, rows=rows)
    except TailError as e:
        _fail(str(e), EXIT_FAILED)
    except KeyboardInterrupt:
        sys.exit(130)


@main.command()
@click.argument("out", type=click.Path(exists=True, file_okay=False))
def inspect(out: str) -> None:
    """Summary of a run directory: status, counts, tokens, files (checked against the disk).
    Exit 0 when the files hold what the manifest committed, 1 when committed records are
    missing or disagree with it (the report says which), 3 when OUT is not a run directory."""
    try:
        report = inspect_run(out)
    except InspectError as e:
        _fail(str(e), EXIT_INPUT)
    click.echo(report.text)
    if report.damaged:
        sys.exit(EXIT_FAILED)


main.add_command(serve)

if __name__ == "__main__":
    main()
