"""The engine process's notification batching and message encoding (no process started)."""

from __future__ import annotations

import time

import batchrun.engine_process.messages as m
from batchrun.engine_process.notify import NotifyBatcher
from batchrun.params import GenerateRequest, GenerateResult, SamplingParams


def result(i: int) -> GenerateResult:
    return GenerateResult(str(i), [1, 2], "length", 3, 2, 0)


def test_holds_until_a_batch_is_ready():
    b = NotifyBatcher(notify_batch=4, max_delay=60)
    b.add([result(i) for i in range(3)])
    assert not b.due(idle=False)
    b.add([result(3)])
    assert b.due(idle=False)
    assert [r.rid for r in b.take()] == ["0", "1", "2", "3"]
    assert not b.due(idle=True) and len(b) == 0


def test_flushes_when_idle_and_after_max_delay():
    b = NotifyBatcher(notify_batch=16, max_delay=0.05)
    b.add([result(0)])
    assert b.due(idle=True)  # the final flush: nothing is left to run
    assert not b.due(idle=False)
    time.sleep(0.06)
    assert b.due(idle=False)  # held too long
    b.take()
    b.add([])
    assert not b.due(idle=True)


def test_counters_alone_go_out_at_a_bounded_rate_while_steps_run():
    b = NotifyBatcher(notify_batch=16, max_delay=0.05)
    b.stepped()
    assert not b.due(idle=False)  # the last message (the start) is younger than max_delay
    assert b.due(idle=True)  # going idle: the final counters go out
    assert b.take() == [] and not b.due(idle=True)  # nothing moved since
    sent, start = 0, time.monotonic()
    while time.monotonic() - start < 0.3:  # steps much faster than max_delay, none finishing
        b.stepped()
        if b.due(idle=False):
            assert b.take() == []
            sent += 1
    assert 3 <= sent <= 6  # about one per max_delay, never one per step


def test_messages_round_trip():
    req = GenerateRequest("r1", [1, 2, 3], SamplingParams(max_new_tokens=4, stop=("x",)))
    msg = m.decode_to_engine(m.encode(m.Submit([req, req])))
    assert msg == m.Submit([req, req])
    assert isinstance(m.decode_to_engine(m.encode(m.DropWaiting())), m.DropWaiting)
    res = m.Results([result(1)], m.EngineCounters(num_steps=3))
    assert m.decode_from_engine(m.encode(res)) == res
    counters = m.EngineCounters(generated_tokens=7, num_running=2, kv_used=9, kv_total=64)
    only = m.Results([], counters)
    assert m.decode_from_engine(m.encode(only)) == only
    assert m.decode_from_engine(m.encode(m.Dropped(5))) == m.Dropped(5)
