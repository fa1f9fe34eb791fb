"""The host gate's bookkeeping on the CPU (engine/host_gate.py; the device side is in
tests/gpu/test_host_gate.py), where the kernel config turns it on, and the fill job's promise to
a gated sampling (structured.py): the rows it does not fill are set to allow all, and the gate
opens, error or not."""

from __future__ import annotations

import sys
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import llama3_model_config, write_config_dir  # noqa: E402

from batchrun.config import EngineConfig, KernelPlan  # noqa: E402
from batchrun.engine import host_gate  # noqa: E402
from batchrun.engine.host_gate import HostGate  # noqa: E402
from batchrun.engine.kernel_choice import resolve_kernels  # noqa: E402


class FakeStream:
    cuda_stream = 1234


def _gate(result: int = 0):
    calls = []

    def wait_value(stream, addr, value, flags):
        calls.append((stream, addr, value, flags))
        return result

    flag = torch.zeros(1, dtype=torch.int32)  # (pinned on CUDA)
    return HostGate(torch.device("cpu"), wait_value, flag.data_ptr(), flag), calls, flag


def test_available_follows_the_driver(monkeypatch):
    """A gate needs libcuda's cuStreamWaitValue32: available() says whether the driver has it."""
    monkeypatch.setattr(host_gate, "_driver", lambda: None)
    assert HostGate.available() is False
    monkeypatch.setattr(host_gate, "_driver", lambda: (object(), lambda *args: 0))
    assert HostGate.available() is True


def test_the_cpu_resolves_no_gate():
    """On the CPU (every op synchronous, no overlap) host_gate resolves to False, and asking
    for one there fails at start-up with what it needs."""
    cpu, model_cfg = torch.device("cpu"), llama3_model_config("tiny")
    assert resolve_kernels(EngineConfig(), model_cfg, cpu).host_gate is False
    with pytest.raises(ValueError, match="host_gate needs CUDA, overlap and a driver"):
        resolve_kernels(EngineConfig(), model_cfg, cpu, KernelPlan(host_gate=True))


def test_an_engine_without_the_gate_has_none(tmp_path):
    from batchrun.engine.engine import Engine

    model = str(write_config_dir("tiny", tmp_path))
    engine = Engine(EngineConfig(model=model, load_format="dummy", device="cpu", kv_budget=64))
    assert engine.kernels.host_gate is False and engine.gate is None


def test_close_waits_for_the_ticket_on_the_stream():
    gate, calls, flag = _gate()
    ticket = gate.next_ticket()
    gate.close(FakeStream(), ticket)
    assert calls == [(1234, flag.data_ptr(), ticket, 0)]  # 0: CU_STREAM_WAIT_VALUE_GEQ
    gate.open(ticket)
    assert flag.view(torch.int32).item() == ticket


def test_a_driver_error_raises():
    gate, _, _ = _gate(result=1)
    with pytest.raises(RuntimeError, match="CUresult 1"):
        gate.close(FakeStream(), gate.next_ticket())


def test_opening_moves_forward_only_cyclically():
    gate, _, flag = _gate()
    word = flag.view(torch.int32)
    first, second = gate.next_ticket(), gate.next_ticket()
    gate.open(second)
    gate.open(first)  # a late job: the word stays
    assert word.item() == second
    # tickets wrap at 2**32; the order survives the wrap
    gate._ticket = 0xFFFFFFFE
    gate._word.value = 0xFFFFFFFE  # as if every ticket up to here had been opened
    near_top, wrapped = gate.next_ticket(), gate.next_ticket()
    wrapped_again = gate.next_ticket()
    assert (near_top, wrapped, wrapped_again) == (0xFFFFFFFF, 0, 1)
    gate.open(near_top)
    gate.open(wrapped_again)
    gate.open(wrapped)  # older than wrapped_again: ignored
    assert word.item() == 1


class FakeBackend:
    fill_shards = 1

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.allowed: list[int] = []
        self.filled: list[int] = []

    def accept_tokens(self, matchers, tokens):
        return None

    def fill_rows(self, matchers, rows, shard=0):
        if self.fail:
            raise RuntimeError("fill broke")
        self.filled.extend(rows)

    def allow_all(self, rows):
        self.allowed.extend(rows)


class FakeReq:
    def __init__(self, finished: bool = False):
        self.matcher = object()
        self.answer_gate = None  # not a thinking model
        self.finish_reason = "stop" if finished else None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


def _structured(backend):
    from batchrun.engine.structured import StructuredOutput

    out = StructuredOutput(lambda: backend, (2,))
    out._backend = backend
    return out


@pytest.mark.parametrize("fail", [False, True])
def test_a_gated_job_fills_or_blanks_every_row_then_opens(fail):
    from batchrun.engine.structured import GateRelease

    backend = FakeBackend(fail)
    structured = _structured(backend)
    opened = []

    class Gate:
        def open(self, ticket):
            opened.append(ticket)

    reqs = [FakeReq(), FakeReq(finished=True), FakeReq(), FakeReq()]
    release = GateRelease([0, 1, 2, 3], Gate(), 7)
    # step n: req 3 samples the stop token (2): no row for it, its token ends it
    step_reqs, out_index, tokens = reqs, [5, 5, 5, 5], [10, 11, 12, 2]
    future: Future = structured.start_fill_after(
        step_reqs, out_index, lambda: tokens, reqs, release=release
    )
    if fail:
        with pytest.raises(RuntimeError, match="fill broke"):
            structured.finish_gated(future)
        assert sorted(backend.allowed) == [0, 1, 2, 3]  # no garbage row reaches the sampler
    else:
        assert structured.finish_gated(future) == []
        assert backend.filled == [0, 2]
        assert sorted(backend.allowed) == [1, 3]  # finished, stopping: allow all
    assert opened == [7]
