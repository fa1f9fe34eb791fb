"""The engine process: load the model, then step the engine for as long as there is work.

Started by `EngineProcess` (client.py) with the spawn method, so CUDA initializes in this process
only. The loop never waits on anything but the device while there is work:

    take every message already waiting (never blocks while there is work)
    -> engine.step() -> finished completions into the NotifyBatcher
    -> at most one `Results` message (completions and counters) when one is due

When there is nothing to run it blocks on the connection until the main process sends more.
Signals are the main process's business: SIGINT / SIGTERM / SIGUSR1 (Ctrl-C in a terminal, Slurm
signalling every process of the job) are ignored here, so that the main process can drain and
commit; it tells this process to stop with `Shutdown`, and a closed connection (the main process
died) ends it too.
"""

from __future__ import annotations

import dataclasses
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

import batchrun.engine_process.messages as m
from batchrun.config import EngineConfig
from batchrun.engine_process.notify import NotifyBatcher
from batchrun.params import GenerateRequest, GenerateResult

GPU_ENGINE_THREADS = 4


def worker_main(
    config: EngineConfig,
    conn: Connection,
    device_index: int | None,
    notify_batch: int,
    max_delay: float,
    engine_factory: Callable | None = None,
) -> None:
    """The engine process's main. `engine_factory(config, device_index)` builds the engine
    (default: batchrun's Engine; tests pass a stand-in with the same surface)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    try:
        engine = (engine_factory or load_engine)(config, device_index)
    except (ValueError, OSError) as e:  # bad path, weights, config: the user can fix it
        _send(conn, m.Failed("model", str(e), traceback.format_exc()))
        return
    except BaseException as e:
        _send(conn, m.Failed("engine", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    _send(
        conn,
        m.Ready(
            context_len=engine.context_len,
            num_kv_slots=engine.num_kv_slots,
            vocab_size=engine.model_config.vocab_size,
            device=str(engine.device),
            kernels=dataclasses.asdict(engine.kernels),
        ),
    )
    try:
        _serve(engine, conn, NotifyBatcher(notify_batch, max_delay))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the main process is gone: nobody to report to
    except BaseException as e:
        try:
            _send(conn, m.Failed("engine", f"{type(e).__name__}: {e}", traceback.format_exc()))
        except OSError:
            pass
    finally:
        close = getattr(engine, "close", None)  # a tensor-parallel group stops its ranks
        if close is not None:
            close()


def load_engine(config: EngineConfig, device_index: int | None):
    """batchrun's Engine on `device_index`; with tp_size > 1, rank 0 of a tensor-parallel group
    on GPUs device_index .. device_index + tp_size - 1 (its other ranks are this process's
    children, and go with it)."""
    # NOTE: local imports: the spawned process imports this module before worker_main ignores
    # the stop signals, and torch and the engine take seconds to import
    import torch

    if config.tp_size > 1:
        from batchrun.engine_process.tp_launcher import start_tp_engine

        return start_tp_engine(config, config.tp_size, base_device_index=device_index or 0)
    from batchrun.engine.engine import Engine

    if device_index is not None:
        torch.cuda.set_device(device_index)
        # NOTE: a GPU engine's host work is single-threaded Python and small tensors; with
        # torch's default of one thread per core, data-parallel engine processes on one host
        # oversubscribe it, and two engines scale far below 2x; with a few threads each they
        # scale past it (docs/benchmarks.md, "Data and tensor parallel")
        torch.set_num_threads(GPU_ENGINE_THREADS)
    return Engine(config)


def _serve(engine, conn: Connection, batcher: NotifyBatcher) -> None:
    decode = m.decode_to_engine
    while True:
        # block only when there is nothing to run (nothing is held then: idle flushes)
        timeout = 0.0 if engine.has_work else None
        while conn.poll(timeout):
            msg = decode(conn.recv_bytes())
            timeout = 0.0
            if isinstance(msg, m.Submit):
                batcher.add(_add_requests(engine, msg.requests))
            elif isinstance(msg, m.DropWaiting):
                dropped = engine.drop_waiting()
                _flush(conn, engine, batcher)  # what finished goes out before the count
                _send(conn, m.Dropped(dropped))
            elif isinstance(msg, m.Shutdown):
                _flush(conn, engine, batcher)
                return
        if engine.has_work:
            batcher.add(engine.step())
            batcher.stepped()
        if batcher.due(idle=not engine.has_work):
            _flush(conn, engine, batcher)


def _add_requests(engine, requests: list[GenerateRequest]) -> list[GenerateResult]:
    """Queue the requests; one the engine refuses comes back at once as an aborted result."""
    refused: list[GenerateResult] = []
    for request in requests:
        try:
            engine.add_request(request)
        except ValueError as e:
            refused.extend(_refusal(request, str(e)))
    return refused


def _refusal(request: GenerateRequest, error: str) -> list[GenerateResult]:
    return [
        GenerateResult(
            rid=request.rid,
            output_ids=[],
            finish_reason="abort",
            prompt_tokens=len(request.input_ids),
            completion_tokens=0,
            cached_tokens=0,
            index=i,
            error=error,
        )
        for i in range(request.params.n)
    ]


def _flush(conn: Connection, engine, batcher: NotifyBatcher) -> None:
    """One `Results`: the held completions (maybe none) and the engine's counters."""
    _send(conn, m.Results(batcher.take(), engine.counters))


def _send(conn: Connection, msg) -> None:
    conn.send_bytes(m.encode(msg))
