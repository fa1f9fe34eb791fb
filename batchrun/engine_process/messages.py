"""What the main process and an engine process say to each other.

Every message is a msgspec Struct in one tagged union, encoded to bytes and sent as one frame on a
`multiprocessing` Connection. Traffic is batched both ways: the main process sends the requests it
has prepared since the last send as one `Submit`; the engine process sends the results of one or
more steps as one `Results` (at most one per step, see notify.py), with the engine's counters
(params.EngineCounters: tokens generated so far, running and waiting requests, KV use).

    main -> engine:  Submit(requests) | DropWaiting() | Shutdown()
    engine -> main:  Ready(...) once after loading | Results(...) | Dropped(n) | Failed(...)
"""

from __future__ import annotations

from typing import Any

import msgspec

from batchrun.params import EngineCounters, GenerateRequest, GenerateResult


class Submit(msgspec.Struct, tag=True, omit_defaults=True):
    requests: list[GenerateRequest]


class DropWaiting(msgspec.Struct, tag=True):
    """Forget the requests that have not started (a graceful stop); answered by `Dropped`."""


class Shutdown(msgspec.Struct, tag=True):
    pass


class Ready(msgspec.Struct, tag=True):
    context_len: int
    num_kv_slots: int
    vocab_size: int
    device: str
    kernels: dict[str, Any]  # the engine's resolved KernelPlan, field by field


class Results(msgspec.Struct, tag=True, omit_defaults=True):
    """Finished completions and the engine's counters; `results` is empty when only the
    counters are due (see notify.py)."""

    results: list[GenerateResult]
    counters: EngineCounters | None = None


class Dropped(msgspec.Struct, tag=True):
    num_samples: int  # completions (n per request) that will never come back


class Failed(msgspec.Struct, tag=True):
    kind: str  # "model": loading the model failed; "engine": the step loop raised
    message: str
    traceback: str = ""


ToEngine = Submit | DropWaiting | Shutdown
FromEngine = Ready | Results | Dropped | Failed

_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode
decode_to_engine = msgspec.msgpack.Decoder(ToEngine).decode
decode_from_engine = msgspec.msgpack.Decoder(FromEngine).decode
