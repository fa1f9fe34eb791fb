"""The host gate (engine/host_gate.py): a stream stops at close() and runs on at open(ticket)."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _gate():
    from batchrun.engine.host_gate import HostGate

    assert HostGate.available(), "cuStreamWaitValue32 should be available on this GPU's driver"
    return HostGate.create(torch.device("cuda"))


def _small():
    """a gate, a side stream, a pinned source and a device destination"""
    return _gate(), torch.cuda.Stream(), torch.ones(16).pin_memory(), torch.zeros(16, device="cuda")


def _gated_copy(gate, stream, src, dst):
    """close the gate, then a copy and an event behind it"""
    with torch.cuda.stream(stream):
        ticket = gate.next_ticket()
        gate.close(stream, ticket)
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return ticket, done


def test_the_stream_waits_until_the_gate_opens():
    gate = _gate()
    stream = torch.cuda.Stream()
    src = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    dst = torch.zeros(1 << 20, device="cuda")
    ticket, done = _gated_copy(gate, stream, src, dst)
    time.sleep(0.05)
    assert not done.query()  # held at the gate
    src.add_(1)  # written by the host after close(): the copy must see it
    gate.open(ticket)
    done.synchronize()
    assert torch.equal(dst.cpu(), src)


def test_an_older_ticket_does_not_open_a_newer_gate_and_tickets_wrap():
    gate, stream, src, dst = _small()
    first, done1 = _gated_copy(gate, stream, src, dst)
    second, done2 = _gated_copy(gate, stream, src, dst)
    gate.open(second)
    gate.open(first)  # late: changes nothing
    done2.synchronize()
    assert done1.query()
    # near the top of the 32-bit range the cyclic comparison still orders tickets
    gate._word.value = gate._ticket = 0xFFFFFFF0
    t1, _ = _gated_copy(gate, stream, src, dst)
    t2, done = _gated_copy(gate, stream, src, dst)
    assert (t1, t2) == (0xFFFFFFF1, 0xFFFFFFF2)
    t3, done3 = _gated_copy(gate, stream, src, dst)
    gate._ticket = 0xFFFFFFFF
    t4, done4 = _gated_copy(gate, stream, src, dst)
    assert t4 == 0  # wrapped
    time.sleep(0.02)
    assert not done4.query()
    gate.open(t4)
    done4.synchronize()
    assert done.query() and done3.query()


def test_a_gate_opened_before_it_closes_does_not_stop_the_stream():
    gate, stream, src, dst = _small()
    ticket = gate.next_ticket()
    gate.open(ticket)  # the job was quick
    with torch.cuda.stream(stream):
        gate.close(stream, ticket)
        dst.copy_(src, non_blocking=True)
    stream.synchronize()
    assert torch.equal(dst.cpu(), src)


def test_the_latest_ticket_releases_every_earlier_close():
    gate, stream, src, dst = _small()
    _gated_copy(gate, stream, src, dst)
    last, done = _gated_copy(gate, stream, src, dst)
    gate.open(last)
    done.synchronize()
    assert torch.equal(dst.cpu(), src)
