"""Start a tensor-parallel engine: rank 0 in the calling process, ranks 1.. in spawned ones.

    from batchrun.engine_process.tp_launcher import start_tp_engine

    with start_tp_engine(EngineConfig(model=...), tp_size=2) as engine:   # a LockstepEngine
        for result in engine.generate(requests):
            ...

Each rank k: sets its device (cuda:base_device_index + k; the CPU with gloo when the config's
device resolves to cpu), joins the default process group (NCCL, or gloo on the CPU) and a gloo
control group, builds a full Engine with tp_rank=k, reports whether that worked, and then rank 0
returns a LockstepEngine while ranks > 0 run `follower_loop` until rank 0 closes it.

Start-up failures are reported, not hung on: every rank says whether its Engine built, and rank 0
raises with the failing rank's message; a rank that dies before joining makes rank 0's join
fail after `timeout_s` with that rank's exit code in the message. The calling process must allow
children (the engine process is started with daemon=False for this); followers are daemonic, so
they end with it.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import traceback
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batchrun.config import EngineConfig, KernelPlan
from batchrun.engine.engine import Engine
from batchrun.engine.model_runner import resolve_device
from batchrun.engine_process.lockstep import LockstepEngine, follower_loop, stop_processes
from batchrun.models.config import ModelConfig
from batchrun.models.embedded import resolve_model_path
from batchrun.parallel.partition import partition_model
from batchrun.parallel.state import disable_nvls, init_distributed

# NOTE: followers wait on the control group for as long as rank 0 has nothing to run (a job
# between inputs); a dead rank 0 still ends them at once (its sockets close)
CONTROL_TIMEOUT = timedelta(days=7)


def start_tp_engine(
    config: EngineConfig,
    tp_size: int,
    base_device_index: int = 0,
    *,
    init_method: str | None = None,
    timeout_s: float = 600.0,
    check_sync: bool = False,
    kernels: KernelPlan | None = None,
) -> LockstepEngine:
    """Start `tp_size` lockstep engines for `config` and return rank 0's LockstepEngine (the
    caller closes it). `init_method`: torch.distributed rendezvous (tcp://127.0.0.1:PORT or
    file:///path); default a free local port. `timeout_s` bounds start-up and every collective.
    `check_sync`: compare the ranks' engine state after every step (tests; see lockstep.py).
    `kernels`: plan fields every rank's Engine takes (a benchmark's or a test's override).
    tp_size 1 builds a plain Engine in this process (no torch.distributed)."""
    replace(config, tp_size=tp_size, tp_rank=0).validate()
    device = resolve_device(config.device)
    is_cuda = device.type == "cuda"
    if is_cuda:
        needed = base_device_index + tp_size
        if torch.cuda.device_count() < needed:
            raise ValueError(
                f"--tp {tp_size} from GPU {base_device_index} needs {needed} GPUs; "
                f"{torch.cuda.device_count()} visible"
            )
        torch.cuda.set_device(base_device_index)
    if tp_size == 1:
        return LockstepEngine(Engine(replace(config, tp_size=1, tp_rank=0), kernels))
    if dist.is_initialized():
        raise RuntimeError(
            "this process already ran a tensor-parallel group (NCCL's are kept until the "
            "process exits, see _destroy_groups): start the next one in a new process"
        )
    model_dir = _check_model(config, tp_size)
    disable_nvls()  # before any NCCL communicator, and inherited by the followers
    backend = "nccl" if is_cuda else "gloo"
    init_method = init_method or f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    followers = []
    try:
        for rank in range(1, tp_size):
            # followers get the resolved directory: a .gguf is converted once, here
            cfg = replace(config, model=str(model_dir), tp_size=tp_size, tp_rank=rank)
            proc = ctx.Process(
                target=_follower_main,
                args=(cfg, base_device_index, init_method, backend, timeout_s, check_sync, kernels),
                name=f"batchrun-tp{rank}",
                daemon=True,
            )
            proc.start()
            followers.append(proc)
        try:
            init_distributed(
                backend, init_method, 0, tp_size, timeout_s, base_device_index if is_cuda else None
            )
        except Exception as e:
            raise _startup_error(followers, "joining the process group failed") from e
        control = dist.new_group(list(range(tp_size)), backend="gloo", timeout=CONTROL_TIMEOUT)
        engine, error = None, ""
        try:
            engine = Engine(replace(config, tp_size=tp_size, tp_rank=0), kernels)
        except Exception as e:
            error, cause = f"{type(e).__name__}: {e}", e
        statuses = _exchange_status(error, control, tp_size)
        if error:
            raise cause
        failed = [(rank, msg) for rank, msg in enumerate(statuses) if msg]
        if failed:
            desc = "; ".join(f"rank {rank}: {msg}" for rank, msg in failed)
            raise RuntimeError(f"tensor-parallel engine failed to start ({desc})")
    except BaseException:
        stop_processes(followers, timeout_s=5.0)
        _destroy_groups(peers_alive=False)
        raise
    return LockstepEngine(
        engine, control, followers, on_close=_destroy_groups, check_sync=check_sync
    )


def _follower_main(
    config: EngineConfig,
    base_device_index: int,
    init_method: str,
    backend: str,
    timeout_s: float,
    check_sync: bool,
    kernels: KernelPlan | None = None,
) -> None:
    """Entry point of rank config.tp_rank > 0 (a spawned process)."""
    # NOTE: a Ctrl-C or a Slurm SIGTERM/USR1 is rank 0's to handle (stop admitting, drain,
    # commit); a follower that died of it would break the drain. Followers end by rank 0's
    # shutdown message, by rank 0's death (the broadcast fails), or by SIGKILL.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    disable_nvls()
    rank, size = config.tp_rank, config.tp_size
    device_index = None
    if backend == "nccl":
        device_index = base_device_index + rank
        torch.cuda.set_device(device_index)
    else:
        # NOTE: CPU ranks share the host's cores; each taking all of them oversubscribes
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    init_distributed(backend, init_method, rank, size, timeout_s, device_index)
    control = dist.new_group(list(range(size)), backend="gloo", timeout=CONTROL_TIMEOUT)
    engine, error = None, ""
    try:
        engine = Engine(config, kernels)
    except Exception as e:
        traceback.print_exc()
        error = f"{type(e).__name__}: {e}"
    statuses = _exchange_status(error, control, size)
    if not any(statuses):
        try:
            follower_loop(engine, control, check_sync)
        except BaseException:
            _destroy_groups(peers_alive=False)  # rank 0 is gone (or broke the protocol)
            raise
    _destroy_groups()  # after the shutdown message, alongside rank 0's teardown
    if any(statuses):
        sys.exit(1)


def _exchange_status(error: str, group, size: int) -> list[str]:
    """Every rank's start-up error ('' for none), rank order, on every rank."""
    statuses: list[str] = [""] * size
    dist.all_gather_object(statuses, error, group=group)
    return statuses


def _check_model(config: EngineConfig, tp_size: int):
    """Fail before spawning anything when the model does not split tp_size ways."""
    model_dir = resolve_model_path(config.model)
    partition_model(ModelConfig.from_dir(model_dir), 0, tp_size)
    return model_dir


def _startup_error(followers, what: str) -> RuntimeError:
    dead = [(i + 1, p.exitcode) for i, p in enumerate(followers) if p.exitcode is not None]
    if dead:
        desc = ", ".join(f"rank {r} exited with code {c}" for r, c in dead)
        return RuntimeError(f"tensor-parallel start-up: {what}: {desc} (see its log above)")
    return RuntimeError(f"tensor-parallel start-up: {what}")


def _free_port() -> int:
    # NOTE: another process may take the port before rank 0 binds it; rare on one host, and
    # init_method='file://...' avoids ports altogether
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _destroy_groups(peers_alive: bool = True) -> None:
    """Tear down the process groups. NOTE: only gloo's. On the H200 pair (torch 2.11, NCCL
    2.28) destroy_process_group() hangs with the NCCL model group, whether rank 0 calls it
    before or after joining the followers (and from another thread it fails with "invalid
    argument"), so NCCL's communicators are left to the process's exit: one tensor-parallel
    group per process (an engine process, or a test's subprocess)."""
    if not dist.is_initialized() or dist.get_backend() == "nccl":
        return
    dist.destroy_process_group()
