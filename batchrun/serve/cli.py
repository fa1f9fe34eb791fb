"""The `batchrun serve` command: options -> ServeConfig -> serve(). Light to import (aiohttp,
torch and the engine load inside the command)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from batchrun.cli.build import build_engine_config
from batchrun.cli.options import engine_options
from batchrun.cli.sections import SectionedCommand, option_group, section_of
from batchrun.config import LOAD_FORMATS
from batchrun.serve.config import (
    DEFAULT_MAX_FILE_BYTES,
    EXECUTORS,
    ServeConfig,
    SlurmOptions,
    parse_models,
)

SERVER = "Server"
SLURM = "Slurm executor"
# the array job script of a checkout (jobs/ is beside the package)
DEFAULT_SCRIPT = Path(__file__).resolve().parents[2] / "jobs" / "batchrun-array.sbatch"

server_options = option_group(
    SERVER,
    click.option("--model", "-m", "models", multiple=True, metavar="NAME=PATH",
                 show_default="the embedded model, as SmolLM2-135M-Instruct",
                 help="A model the rows may name in body.model (repeatable)."),
    click.option("--data-dir", required=True, type=click.Path(file_okay=False),
                 help="Files, batches and their runs (state.db: SQLite, WAL)."),
    click.option("--host", default="127.0.0.1", show_default=True,
                 help="Address to listen on; a non-loopback one needs --api-key-file."),
    click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True,
                 help="Port to listen on."),
    click.option("--api-key-file", type=click.Path(dir_okay=False), default=None,
                 show_default="none: loopback only, no keys",
                 help="API keys, one a line; each key sees only its own files and batches."),
    click.option("--max-file-bytes", type=click.IntRange(min=1), default=DEFAULT_MAX_FILE_BYTES,
                 show_default=True, help="Largest upload; a larger one gets 413."),
    click.option("--executor", type=click.Choice(EXECUTORS), default="local", show_default=True,
                 help="local: this box's engine; slurm: each batch an array job."),
    click.option("--load-format", type=click.Choice(LOAD_FORMATS), default="auto",
                 show_default=True, help="Weights: dummy is random, from config.json."),
    click.option("--seed", type=int, default=0, show_default=True,
                 help="Base seed; a row's derives from it."),
    click.option("--commit-every", type=click.IntRange(min=1), default=1000, show_default=True,
                 help="Commit a batch's rows at least every N rows."),
    click.option("--drain-timeout", type=click.FloatRange(min=0), default=30.0,
                 show_default=True, help="On stop or cancel: seconds for the rows in flight."),
)  # fmt: skip

slurm_options = option_group(
    SLURM,
    click.option("--slurm-tasks", type=click.IntRange(min=1), default=1, show_default=True,
                 help="Array tasks (shards) per batch."),
    click.option("--slurm-script", type=click.Path(dir_okay=False), default=str(DEFAULT_SCRIPT),
                 show_default="jobs/batchrun-array.sbatch", help="The array job script."),
    click.option("--slurm-sbatch-arg", "sbatch_args", multiple=True, metavar="ARG",
                 show_default="none", help="An sbatch argument (repeatable), e.g. "
                 "--slurm-sbatch-arg=--partition=gpu."),
    click.option("--slurm-submit-arg", "submit_args", multiple=True, metavar="ARG",
                 show_default="none", help="A `batchrun submit` argument of every task "
                 "(repeatable): the tasks' engine options."),
)  # fmt: skip


@click.command(cls=SectionedCommand)
@server_options
@engine_options
@slurm_options
def serve(**o) -> None:
    """The OpenAI Files and Batches API over batchrun, durable in --data-dir.

    \b
    batchrun serve --data-dir serve-data                       # embedded model, loopback
    batchrun serve --data-dir /srv/batches --host 0.0.0.0 --api-key-file keys.txt \\
        --model llama-8b=~/models/Llama-3.1-8B-Instruct --dp 8

    Clients use the official `openai` package with base_url http://HOST:PORT/v1. One batch
    runs at a time (first in, first out) on one engine per GPU (--dp: default every GPU), as a
    batchrun run directory under --data-dir/runs/; killed and started again, the server
    continues every batch where it stopped. SIGTERM / Ctrl-C: the running batch drains and
    commits, then the server exits 0.
    """
    try:
        models = parse_models(o["models"])
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    slurm = None
    if o["executor"] == "slurm":
        _refuse_engine_options()
        if not Path(o["slurm_script"]).is_file():
            raise click.UsageError(
                f"--slurm-script {o['slurm_script']}: no such file (jobs/batchrun-array.sbatch "
                "of a batchrun checkout, or your own array job script)"
            )
        batchrun = Path(sys.executable).parent / "batchrun"
        slurm = SlurmOptions(
            script=o["slurm_script"],
            tasks=o["slurm_tasks"],
            sbatch_args=tuple(o["sbatch_args"]),
            submit_args=tuple(o["submit_args"]),
            batchrun=str(batchrun) if batchrun.exists() else "batchrun",
        )
    elif o["sbatch_args"] or o["submit_args"]:
        raise click.UsageError("--slurm-sbatch-arg / --slurm-submit-arg need --executor slurm")
    engine = build_engine_config({**o, "model": None, "quantization": None})
    dp = o["dp"] if _given("dp") or o["executor"] == "slurm" else _every_gpu(o)
    if dp > 1 and not o["engine_process"]:
        raise click.UsageError("--dp runs engine processes; drop --in-process")
    config = ServeConfig(
        data_dir=Path(os.path.expanduser(o["data_dir"])),
        models=models,
        host=o["host"],
        port=o["port"],
        api_key_file=o["api_key_file"],
        max_file_bytes=o["max_file_bytes"],
        engine=engine,
        engine_process=o["engine_process"],
        dp=dp,
        notify_batch=o["notify_batch"],
        commit_every=o["commit_every"],
        drain_timeout=o["drain_timeout"],
        executor=o["executor"],
        slurm=slurm,
    )
    from batchrun.serve.auth import KeyFileError
    from batchrun.serve.server import ServeError
    from batchrun.serve.server import serve as run_server

    try:
        run_server(config, say=click.echo)
    except (ServeError, KeyFileError) as e:
        raise click.UsageError(str(e)) from e
    except OSError as e:
        click.echo(f"error: cannot serve on {o['host']}:{o['port']}: {e}", err=True)
        sys.exit(1)


def _given(name: str) -> bool:
    source = click.get_current_context().get_parameter_source(name)
    return source not in (None, ParameterSource.DEFAULT)


def _every_gpu(o: dict) -> int:
    """--dp not given: one engine per GPU of the box (per --tp group), 1 on the CPU or with
    --in-process."""
    if o["device"] == "cpu" or not o["engine_process"]:
        return 1
    import torch  # local: `batchrun --help` never loads torch

    return max(1, torch.cuda.device_count() // o["tp"]) if torch.cuda.is_available() else 1


def _refuse_engine_options() -> None:
    """With --executor slurm the array tasks run the engine: its options go to them."""
    ctx = click.get_current_context()
    given = [
        p.opts[0]
        for p in ctx.command.params
        if section_of(p) not in (SERVER, SLURM, None)
        and ctx.get_parameter_source(p.name) == ParameterSource.COMMANDLINE
    ]
    if given:
        raise click.UsageError(
            f"{', '.join(given)}: with --executor slurm the array tasks run the engine; give "
            "its options as --slurm-submit-arg=OPTION (one per argument)"
        )
