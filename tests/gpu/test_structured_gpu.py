"""Structured output on CUDA: the bitmask filled while the device runs (overlap) gives the same
tokens as overlap off, every output is accepted by its grammar, and the Triton mask kernel equals
the torch reference. Tiny chat model (random weights, byte tokenizer)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

pytest.importorskip("xgrammar")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_models import make_tiny_chat_model

    path = tmp_path_factory.mktemp("tinychat-gpu")
    make_tiny_chat_model(path)
    return str(path)


def _requests():
    from tiny_models import TINY_JSON_SCHEMA, random_prompts

    from batchrun.params import GenerateRequest, GrammarSpec, SamplingParams

    specs = [
        GrammarSpec("json_schema", json.dumps(TINY_JSON_SCHEMA)),
        GrammarSpec("regex", r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"),
        GrammarSpec("choice", json.dumps(["alpha", "beta", "gamma"])),
        GrammarSpec("regex", "[a-z]{30}"),
    ]
    reqs = []
    for i, p in enumerate(random_prompts(48, seed=21, min_len=4, max_len=80)):
        grammar = None if i % 4 == 3 else specs[i % len(specs)] if i % 8 else specs[3]
        params = SamplingParams(max_new_tokens=40, temperature=0.0, grammar=grammar)
        reqs.append(GenerateRequest(str(i), p, params))
    return reqs


def _run(model_dir: str, kernels=None, **kw):
    """(engine, results) of the requests on an fp32 engine; kernels: a KernelPlan, else the
    defaults; kw: other EngineConfig fields."""
    from batchrun.config import EngineConfig
    from batchrun.engine.engine import Engine

    cfg = dict(model=model_dir, device="cuda", dtype="float32", kv_budget=20000)
    engine = Engine(EngineConfig(**{**cfg, **kw}), kernels=kernels)
    out = {r.rid: r for r in engine.generate(_requests())}
    engine.check_integrity()
    return engine, out


def _sharded_engine(model_dir: str, monkeypatch):
    """An engine whose fill jobs run in 3 parts, even for small batches (structured.py)."""
    from batchrun.config import EngineConfig
    from batchrun.engine import structured
    from batchrun.engine.engine import Engine

    monkeypatch.setattr(structured, "MIN_SHARD_ROWS", 2)
    cfg = EngineConfig(model=model_dir, device="cuda", dtype="float32", kv_budget=20000)
    engine = Engine(cfg)
    engine.grammar.set_fill_parallelism(1, 3)
    return engine


def test_overlap_on_off_identical_and_valid(model_dir, monkeypatch):
    """Grammar requests give the same tokens with overlap off, with overlap (the sampling behind
    the host gate), with the fill jobs in parts, without graphs, and with the host gate off
    (host_gate=False: the step loop waits for the fill job); every output is accepted by its
    grammar."""
    from batchrun.config import KernelPlan

    _, off = _run(model_dir, overlap=False)
    engine, on = _run(model_dir, overlap=True)
    assert engine.gate is not None  # the sampling went in behind the host gate
    stats = engine.stats  # ... and the device's time there was measured
    assert stats.num_gated_steps > 10
    assert stats.gate_wait_time >= 0.0 and stats.mask_copy_time > 0.0
    _, eager = _run(model_dir, KernelPlan(cuda_graph_max_bs=0), overlap=True)
    sharded_engine = _sharded_engine(model_dir, monkeypatch)
    sharded = {r.rid: r for r in sharded_engine.generate(_requests())}
    assert sharded_engine.stats.num_gated_steps > 10
    ungated_engine, ungated = _run(model_dir, KernelPlan(host_gate=False), overlap=True)
    assert ungated_engine.kernels.host_gate is False
    assert ungated_engine.gate is None  # the step loop waits for the fill job
    tokens = {k: r.output_ids for k, r in on.items()}
    assert tokens == {k: r.output_ids for k, r in off.items()}
    assert tokens == {k: r.output_ids for k, r in sharded.items()}
    assert tokens == {k: r.output_ids for k, r in eager.items()}
    assert tokens == {k: r.output_ids for k, r in ungated.items()}
    stops = 0
    for req in _requests():
        res = on[req.rid]
        if req.params.grammar is None:
            continue
        m = engine.grammar.matcher(engine.grammar.compile(req.params.grammar).result())
        assert all(m.accept_token(t) for t in res.output_ids), res
        if res.finish_reason == "stop":
            assert m.is_terminated()
            stops += 1
    assert stops >= 24


FRESH_PROCESS = """
import sys
sys.path.insert(0, {tests!r})
from test_structured_gpu import _run
engine, out = _run({model!r}, overlap=True)
assert engine.gate is not None and len(out) == 48
print("ok")
"""


def test_a_fresh_process_whose_first_grammar_step_is_gated_finishes(model_dir):
    """The first gated step of a process loads the mask kernel (an implicit device sync) while
    its gate is closed; that must wait for the running fill job, not deadlock on one that the
    same thread has yet to start (host_gate.py)."""
    import subprocess

    tests = str(Path(__file__).resolve().parent)
    code = FRESH_PROCESS.format(tests=tests, model=model_dir)
    # NOTE: not the checkout's root as cwd: its batchrun/ would shadow an installed wheel's
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(model_dir).parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_a_rejected_token_aborts_that_request_only_gated(model_dir, monkeypatch):
    """A matcher that refuses a token (made up here) on a gated step: that request ends
    `abort` at that token, the others are untouched, and the device never hangs."""
    _, expected = _run(model_dir, overlap=True)
    from batchrun.config import EngineConfig
    from batchrun.engine.engine import Engine

    engine = Engine(EngineConfig(model=model_dir, device="cuda", dtype="float32", kv_budget=20000))
    assert engine.gate is not None
    real = engine.grammar.accept_tokens
    victim = next(r.rid for r in _requests() if r.params.grammar is not None)
    seen = {"n": 0}

    def victim_matcher():
        return next((r.matcher for r in engine.scheduler.running if r.rid == victim), None)

    def accept(matchers, tokens):
        ok = real(matchers, tokens)
        ok = [True] * len(matchers) if ok is None else list(ok)
        target = victim_matcher()
        for i, m in enumerate(matchers):
            if m is target:
                seen["n"] += 1
                if seen["n"] == 3:  # the victim's third output token
                    m.rollback(1)
                    ok[i] = False
        return ok

    monkeypatch.setattr(engine.grammar, "accept_tokens", accept)
    out = {r.rid: r for r in engine.generate(_requests())}
    engine.check_integrity()
    bad = out[victim]
    assert bad.finish_reason == "abort" and "rejected sampled token" in bad.error
    assert bad.output_ids == expected[victim].output_ids[:3]
    for rid, res in out.items():
        if rid != victim:
            assert res.output_ids == expected[rid].output_ids, rid


def test_a_failing_fill_job_still_opens_the_gate(model_dir, monkeypatch):
    """An error in the fill job surfaces from step(); the gate it would open is opened anyway,
    so the device (and a sync on it) does not hang."""
    from batchrun.config import EngineConfig
    from batchrun.engine.engine import Engine

    engine = Engine(EngineConfig(model=model_dir, device="cuda", dtype="float32", kv_budget=20000))

    def broken(matchers, rows, shard=0):
        raise RuntimeError("fill broke")

    monkeypatch.setattr(engine.grammar, "fill_rows", broken)
    with pytest.raises(RuntimeError, match="fill broke"):
        for _ in engine.generate(_requests()):
            pass
    torch.cuda.synchronize()  # returns: nothing on the stream waits on a closed gate


@pytest.mark.parametrize("mask_vocab", [128256, 49152, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_mask_equals_torch_reference(mask_vocab, dtype):
    """kernels/token_bitmask.py against the torch unpacking (+ -inf past the tokenizer)."""
    from batchrun.kernels.token_bitmask import apply_token_bitmask_

    from batchrun.engine.grammar import apply_mask_torch

    g = torch.Generator(device="cuda").manual_seed(0)
    vocab = 128256
    logits = torch.randn(64, vocab, device="cuda", generator=g).to(dtype)
    words = (mask_vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (64, words), device="cuda", generator=g)
    bitmask = bitmask.to(torch.int32)
    indices = torch.tensor([0, 5, 17, 63], dtype=torch.int32, device="cuda")
    want = logits.clone()
    apply_mask_torch(want[:, :mask_vocab], bitmask, indices)
    want[indices.long(), mask_vocab:] = float("-inf")
    got = logits.clone()
    apply_token_bitmask_(got, bitmask, indices, mask_vocab)
    assert torch.equal(got, want)
    untouched = [i for i in range(64) if i not in (0, 5, 17, 63)]
    assert torch.equal(got[untouched], logits[untouched])


@pytest.mark.parametrize("mask_vocab", [128256, 49152, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_argmax_equals_apply_then_argmax(mask_vocab, dtype):
    """kernels/token_bitmask.py's fused greedy against the mask kernel + torch.argmax: sparse
    and dense masks, rows without a mask, a row with nothing allowed, ties (lowest id wins)."""
    from batchrun.kernels.token_bitmask import apply_token_bitmask_, masked_argmax

    g = torch.Generator(device="cuda").manual_seed(1)
    rows, vocab = 48, 128256
    logits = torch.randn(rows, vocab, device="cuda", generator=g)
    logits = (logits * 4).round().to(dtype)  # coarse values: many ties
    words = (mask_vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), device="cuda", generator=g)
    bitmask = bitmask.to(torch.int32)
    bitmask[1::4] &= 0x00100001  # sparse rows: a JSON grammar allows few tokens
    bitmask[7] = 0  # nothing allowed
    flags = torch.ones(rows, dtype=torch.int32, device="cuda")
    flags[3::5] = 0  # rows without a grammar
    masked_rows = flags.nonzero().flatten().to(torch.int32)
    want = logits.clone()
    apply_token_bitmask_(want, bitmask, masked_rows, mask_vocab)
    got = masked_argmax(logits, bitmask, flags, mask_vocab)
    assert torch.equal(got, want.argmax(dim=-1))
    assert got[7] == 0


def test_grammar_greedy_rows_take_the_fused_kernel(model_dir, monkeypatch):
    """A plain-greedy grammar batch samples through masked_argmax (checked by counting calls);
    the tokens equal the apply + sampler path's (test_overlap_on_off_identical_and_valid runs
    both: overlap off uploads without row flags, so it takes apply + sampler)."""
    from batchrun.kernels import token_bitmask
    from spies import count_calls

    calls = count_calls(monkeypatch, token_bitmask, "masked_argmax")
    _, out = _run(model_dir, overlap=True)
    assert calls["n"] > 10 and len(out) == 48
