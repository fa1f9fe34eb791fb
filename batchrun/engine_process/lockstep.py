"""Tensor-parallel engines in lockstep: one full Engine per rank, driven by rank 0.

Every rank runs the same scheduler on the same requests, so every rank makes the same decisions;
the model's collectives (all-reduce after attention and MLP, all-gather of the logits) meet
because every rank runs the same forwards, and sampling is identical because every rank sees the
same full logits and the per-request seeded RNG. Only rank 0 talks to the caller. Before each
step it broadcasts what the caller did since the last one, and the followers replay it:

    rank 0 (LockstepEngine)                      rank k > 0 (follower_loop)
    add_request(r)   -> engine.add_request(r),   |
                        remember ("add", r)      |
    drop_waiting()   -> engine.drop_waiting(),   |
                        remember ("drop",)       |
    step()           -> broadcast [STEP, calls] -+-> replay calls in order; engine.step()
                        engine.step()            |
    score(ids)       -> broadcast [SCORE, ids]  -+-> engine.score(ids)
    close()          -> broadcast [SHUTDOWN]    -+-> return

Messages go over a gloo group (host memory, also when the model's group is NCCL): a 2-int header
(op, payload bytes) and, only when there is something to replay, a msgspec-encoded payload. A
decode step with no new requests costs one 16-byte broadcast.

Interface (what the job runner / engine process uses; the same surface as Engine):

    engine = start_tp_engine(config, tp_size, base_device_index=0)   # tp_launcher.py
    engine.add_request(request: GenerateRequest) -> None    # raises ValueError like Engine's
    engine.step() -> list[GenerateResult]
    engine.wants_requests -> bool;  engine.has_work -> bool
    engine.drop_waiting() -> int
    engine.generate(requests) -> Iterator[GenerateResult]
    engine.score(input_ids: list[int]) -> Tensor [T, vocab]  (idle engine; tests, scoring)
    engine.close() -> None           # also a context manager
    engine.config / kernels / model_config / context_len / vocab_size / num_kv_slots / device /
        stats / counters / tokenizer / eos_token_ids / model_dir / runner / check_integrity:
        rank 0's, read-only

Mutating rank 0's Engine other than through these (say, resetting its radix cache) desyncs the
ranks: their next collectives mismatch. So does anything in Engine.step that depends on timing
rather than on the calls (a background compile that is done on one rank and not yet on
another): the engine must make such decisions deterministic when config.tp_size > 1.
`check_sync=True` compares a fingerprint of every rank's engine after each step (one more
small collective) and raises at the first divergence: tests turn it on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import msgspec
import torch
import torch.distributed as dist

from batchrun.engine.engine import drive
from batchrun.params import GenerateRequest, GenerateResult

OP_STEP, OP_SCORE, OP_SHUTDOWN = 1, 2, 3
_OPS = {OP_STEP: "step", OP_SCORE: "score", OP_SHUTDOWN: "shutdown"}


class AddRequests(msgspec.Struct, tag="add"):
    requests: list[GenerateRequest]


class DropWaiting(msgspec.Struct, tag="drop"):
    pass


class Replay(msgspec.Struct, omit_defaults=True):
    """What rank 0's caller did since the last broadcast, in order."""

    calls: list[AddRequests | DropWaiting] = []
    input_ids: list[int] = []  # OP_SCORE's sequence


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Replay)

# read-only attributes of rank 0's Engine that LockstepEngine passes through
_PASSTHROUGH = frozenset(
    (
        "config",
        "kernels",
        "model_config",
        "context_len",
        "vocab_size",
        "counters",
        "num_kv_slots",
        "device",
        "stats",
        "tokenizer",
        "eos_token_ids",
        "model_dir",
        "runner",
        "check_integrity",
    )
)


class FollowerDiedError(RuntimeError):
    """A tensor-parallel rank's process is gone; the engine cannot step any more."""


class LockstepEngine:
    """Rank 0's Engine plus the broadcast that keeps the other ranks' engines in step.

    `group`: the gloo control group (None at tp_size 1: then this is a thin pass-through);
    `followers`: the processes of ranks 1.., watched so that a dead one fails the next step with
    a clear error instead of a hang; `on_close`: called once by close(), right after the shutdown
    message and before joining the followers (the launcher tears down the process groups there;
    see close()).
    """

    def __init__(
        self,
        engine,
        group=None,
        followers: Sequence = (),
        on_close: Callable[[bool], None] | None = None,
        join_timeout_s: float = 30.0,
        check_sync: bool = False,
    ):
        self.engine = engine
        self.group = group
        self.followers = list(followers)
        self.check_sync = check_sync and group is not None
        self._on_close = on_close
        self._join_timeout_s = join_timeout_s
        self._calls: list[AddRequests | DropWaiting] = []
        self._closed = False

    @property
    def tp_size(self) -> int:
        return 1 + len(self.followers) if self.group is not None else 1

    def __getattr__(self, name: str):
        if name in _PASSTHROUGH:
            return getattr(self.engine, name)
        raise AttributeError(f"LockstepEngine has no attribute {name!r}")

    # -- the Engine surface ----------------------------------------------------------------------

    def add_request(self, request: GenerateRequest) -> None:
        self.engine.add_request(request)  # validates; raises before anything is recorded
        if self.group is None:
            return
        if self._calls and isinstance(self._calls[-1], AddRequests):
            self._calls[-1].requests.append(request)
        else:
            self._calls.append(AddRequests([request]))

    def drop_waiting(self) -> int:
        dropped = self.engine.drop_waiting()
        if self.group is not None:
            self._calls.append(DropWaiting())
        return dropped

    @property
    def wants_requests(self) -> bool:
        return self.engine.wants_requests

    @property
    def has_work(self) -> bool:
        return self.engine.has_work

    def step(self) -> list[GenerateResult]:
        self._broadcast(OP_STEP)
        results = self._guarded(self.engine.step)
        if self.check_sync:
            prints = self._guarded(lambda: gather_fingerprints(self.engine, self.group))
            if any(p != prints[0] for p in prints):
                raise RuntimeError(
                    "tensor-parallel ranks diverged (fingerprint per rank: (steps, forward "
                    f"tokens, finished, output tokens, has work)): {prints}"
                )
        return results

    def score(self, input_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits [T, vocab] of one sequence (every rank runs the forward)."""
        if self.engine.has_work:
            raise RuntimeError("score() needs an idle engine")
        self._broadcast(OP_SCORE, list(input_ids))
        return self._guarded(lambda: self.engine.score(input_ids))

    def generate(self, requests: Iterable[GenerateRequest]) -> Iterator[GenerateResult]:
        """Engine.generate over this wrapper's add_request / step."""
        return drive(self, requests)

    def close(self) -> None:
        """Stop the followers (shutdown message, then join; kill what does not exit) and
        release the process groups. Safe to call twice, and after a failure."""
        if self._closed:
            return
        self._closed = True
        shutdown_sent = False
        try:
            if self.group is not None and not self.dead_followers():
                self._calls.clear()
                self._broadcast(OP_SHUTDOWN)
                shutdown_sent = True
        except Exception:  # a broken group: the kill below still ends the followers
            pass
        # NOTE: NCCL's group teardown pairs up across ranks: rank 0 tears down while the
        # followers do (right after the shutdown message), before joining them. Joining first
        # hangs on the H200 pair (each side waits for the other). Without a shutdown (a dead
        # rank) the followers are stopped first; the teardown gives up after a timeout.
        if self._on_close is not None and shutdown_sent:
            self._on_close(True)
        stop_processes(self.followers, self._join_timeout_s)
        if self._on_close is not None and not shutdown_sent:
            self._on_close(False)  # peers gone: see tp_launcher._destroy_groups

    def __enter__(self) -> LockstepEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- plumbing ---------------------------------------------------------------------------------

    def dead_followers(self) -> list[tuple[int, int]]:
        """(rank, exit code) of each follower whose process has exited."""
        return [(i + 1, p.exitcode) for i, p in enumerate(self.followers) if p.exitcode is not None]

    def _check_followers(self) -> None:
        dead = self.dead_followers()
        if dead:
            raise _died(dead)

    def _guarded(self, fn):
        """Run fn; if it fails because a follower died (a collective broke), say so."""
        try:
            return fn()
        except Exception as e:
            for p in self.followers:
                p.join(timeout=1.0)  # its sockets close as it exits: let it finish exiting
            dead = self.dead_followers()
            if dead:
                raise _died(dead) from e
            raise

    def _broadcast(self, op: int, input_ids: list[int] | None = None) -> None:
        if self._closed and op != OP_SHUTDOWN:
            raise RuntimeError("the tensor-parallel engine is closed")
        if self.group is None:
            return
        self._check_followers()
        payload = b""
        if self._calls or input_ids:
            payload = _encoder.encode(Replay(self._calls, input_ids or []))
        self._calls = []
        header = torch.tensor([op, len(payload)], dtype=torch.int64)

        def send() -> None:
            dist.broadcast(header, src=0, group=self.group)
            if payload:
                data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                dist.broadcast(data, src=0, group=self.group)

        self._guarded(send)


def _died(dead: list[tuple[int, int]]) -> FollowerDiedError:
    desc = ", ".join(f"rank {r} (exit code {c})" for r, c in dead)
    return FollowerDiedError(
        f"tensor-parallel {desc} exited; the engine cannot continue (see that rank's log "
        "above for its error)"
    )


def follower_loop(engine, group, check_sync: bool = False) -> None:
    """Rank k > 0: replay rank 0's calls and steps until it says shutdown. Returns then; raises
    if rank 0 goes away (the broadcast fails) or sends something this rank cannot replay.
    `check_sync` must match rank 0's LockstepEngine."""
    header = torch.empty(2, dtype=torch.int64)
    while True:
        dist.broadcast(header, src=0, group=group)
        op, size = header.tolist()
        replay = Replay()
        if size:
            data = torch.empty(size, dtype=torch.uint8)
            dist.broadcast(data, src=0, group=group)
            replay = _decoder.decode(data.numpy().tobytes())
        if op == OP_SHUTDOWN:
            return
        for call in replay.calls:
            if isinstance(call, AddRequests):
                for request in call.requests:
                    engine.add_request(request)
            else:
                engine.drop_waiting()
        if op == OP_STEP:
            engine.step()  # results are rank 0's to report
            if check_sync:
                gather_fingerprints(engine, group)
        elif op == OP_SCORE:
            engine.score(replay.input_ids)
        else:
            raise RuntimeError(f"lockstep: unknown op {op} from rank 0")


def gather_fingerprints(engine, group) -> list[tuple]:
    """Every rank's engine state after a step, as cheap counters (rank order)."""
    stats = engine.stats
    mine = (
        stats.num_steps,
        stats.num_forward_tokens,
        stats.num_finished,
        stats.output_tokens,
        engine.has_work,
    )
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return out


def stop_processes(processes: Sequence, timeout_s: float) -> None:
    """Join each process; kill the ones still running after timeout_s (followers ignore
    SIGTERM, see tp_launcher.py)."""
    for p in processes:
        p.join(timeout=timeout_s)
    for p in processes:
        if p.exitcode is None:
            p.kill()
            p.join(timeout=5.0)
