"""Structured output inside the engine, on the tiny chat model (random weights, byte tokenizer):
overlap on/off, free rows untouched, n > 1, retraction, max_tokens, a compile that is still
running, a spec that does not compile. Random weights write garbage, but grammar-valid garbage."""

from __future__ import annotations

import json
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest

pytest.importorskip("xgrammar")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from spies import count_calls  # noqa: E402
from tiny_models import TINY_JSON_SCHEMA, make_tiny_chat_model, random_prompts  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.params import GenerateRequest, GrammarSpec, SamplingParams  # noqa: E402

SCHEMA = TINY_JSON_SCHEMA
SPECS = [
    GrammarSpec("json_schema", json.dumps(SCHEMA)),
    GrammarSpec("regex", r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"),
    GrammarSpec("choice", json.dumps(["alpha", "beta", "gamma"])),
    GrammarSpec("ebnf", 'root ::= "(" [0-9]+ ")" | "x"'),
]
LONG = GrammarSpec("regex", "[a-z]{40}")
GREEDY = SamplingParams(max_new_tokens=48, temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tinychat")
    make_tiny_chat_model(path)
    return str(path)


def make_engine(model_dir: str, **kw) -> Engine:
    cfg = dict(model=model_dir, device="cpu", dtype="float32", kv_budget=8192)
    return Engine(EngineConfig(**{**cfg, **kw}))


def workload(num: int = 16, free: bool = True) -> list[GenerateRequest]:
    prompts = random_prompts(num, seed=5, min_len=8, max_len=48)
    reqs = []
    for i, p in enumerate(prompts):
        if free and i % 3 == 2:
            reqs.append(GenerateRequest(f"free{i}", p, GREEDY))
        else:
            grammar = SPECS[i % len(SPECS)]
            params = SamplingParams(max_new_tokens=48, temperature=0.0, grammar=grammar)
            reqs.append(GenerateRequest(f"g{i}", p, params))
    return reqs


def run(engine: Engine, reqs) -> dict:
    out = {}
    for res in engine.generate(reqs):
        out[res.rid, res.index] = res
        engine.check_integrity()
    assert not engine.has_work
    return out


def check_valid(engine: Engine, spec: GrammarSpec, res) -> None:
    """A fresh matcher accepts the output; a `stop` output is complete."""
    m = engine.grammar.matcher(engine.grammar.compile(spec).result())
    assert res.finish_reason in ("stop", "length"), res
    for t in res.output_ids:
        assert m.accept_token(t), (res, t)
    if res.finish_reason == "stop":
        assert m.is_terminated(), res
        assert res.output_ids[-1] in engine.eos_token_ids


def test_overlap_on_off_and_free_rows(model_dir):
    reqs = workload()
    off = run(make_engine(model_dir, overlap=False), reqs)
    engine = make_engine(model_dir, overlap=True)  # on the CPU: the same code, in order
    on = run(engine, reqs)
    assert {k: r.output_ids for k, r in on.items()} == {k: r.output_ids for k, r in off.items()}
    stops = 0
    for req in reqs:
        res = on[req.rid, 0]
        if req.params.grammar is not None:
            check_valid(engine, req.params.grammar, res)
            stops += res.finish_reason == "stop"
    assert stops >= 8
    alone = run(engine, [r for r in reqs if r.params.grammar is None])
    for key, res in alone.items():
        assert on[key].output_ids == res.output_ids, key


def sharded(engine: Engine, monkeypatch, shards: int = 3) -> dict:
    """Fill jobs of this engine in `shards` parts, even for small batches; counts the jobs."""
    from batchrun.engine import structured

    monkeypatch.setattr(structured, "MIN_SHARD_ROWS", 2)
    engine.grammar.set_fill_parallelism(1, shards)
    return count_calls(monkeypatch, engine.structured, "_sharded_job")


@pytest.mark.parametrize("overlap", [False, True])
def test_a_fill_job_in_shards_gives_the_same_tokens(model_dir, monkeypatch, overlap):
    """Each shard accepts its own requests' tokens and fills their rows, on threads of their
    own: the same outputs as one job, every grammar output valid."""
    reqs = workload(24)
    whole = run(make_engine(model_dir, overlap=overlap), reqs)
    engine = make_engine(model_dir, overlap=overlap)
    calls = sharded(engine, monkeypatch)
    parts = run(engine, reqs)
    assert calls["n"] > 10
    assert {k: r.output_ids for k, r in parts.items()} == {
        k: r.output_ids for k, r in whole.items()
    }
    for req in reqs:
        if req.params.grammar is not None:
            check_valid(engine, req.params.grammar, parts[req.rid, 0])


def test_retraction_keeps_matchers_valid(model_dir):
    # long outputs, so that decode growth runs the pool dry and requests get retracted
    params = SamplingParams(max_new_tokens=48, temperature=0.0, grammar=LONG)
    reqs = [
        *workload(8, free=False),
        *(
            GenerateRequest(f"long{i}", p, params)
            for i, p in enumerate(random_prompts(16, seed=6, min_len=8, max_len=48))
        ),
    ]  # noqa: E501
    roomy = run(make_engine(model_dir), reqs)
    engine = make_engine(model_dir, kv_budget=320, max_running=16)
    # NOTE: every grammar compiled first: a request waits for its compile before it is admitted,
    # and compiles that finish late (a loaded machine) spread the admissions so that the pool
    # never runs dry and nothing is retracted
    for spec in {LONG, *SPECS}:
        engine.grammar.compile(spec).result()
    tight = run(engine, reqs)
    assert engine.scheduler.num_retractions > 0
    for key, res in tight.items():
        check_valid(engine, LONG if key[0].startswith("long") else SPECS[int(key[0][1:]) % 4], res)
    assert {k: r.output_ids for k, r in tight.items()} == {
        k: r.output_ids for k, r in roomy.items()
    }


def test_sampling_n_penalties_and_length(model_dir):
    engine = make_engine(model_dir)
    prompt = random_prompts(1, seed=9)[0]
    spec = SPECS[1]
    sampled = SamplingParams(
        max_new_tokens=48, temperature=1.0, top_k=20, repetition_penalty=1.3, n=4, grammar=spec
    )
    short = SamplingParams(
        max_new_tokens=3, temperature=0.0, grammar=GrammarSpec("regex", "[a-z]{9}")
    )
    ignore = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True, grammar=SPECS[2])
    out = run(
        engine,
        [
            GenerateRequest("s", prompt, sampled),
            GenerateRequest("short", prompt, short),
            GenerateRequest("ignore", prompt, ignore),
        ],
    )
    texts = set()
    for i in range(4):
        check_valid(engine, spec, out["s", i])
        assert out["s", i].finish_reason == "stop"
        texts.add(tuple(out["s", i].output_ids))
    assert len(texts) > 1  # each sample has its own matcher and draws
    assert out["short", 0].finish_reason == "length" and len(out["short", 0].output_ids) == 3
    check_valid(engine, short.grammar, out["short", 0])
    # the grammar ends the request even with ignore_eos
    assert out["ignore", 0].finish_reason == "stop"
    check_valid(engine, SPECS[2], out["ignore", 0])


def test_pending_compile_does_not_block_others(model_dir, monkeypatch):
    engine = make_engine(model_dir)
    real = engine.grammar.compile
    pending: Future = Future()
    slow = GrammarSpec("regex", "[0-9]{3}")
    monkeypatch.setattr(
        engine.grammar, "compile", lambda spec: pending if spec == slow else real(spec)
    )
    prompts = random_prompts(2, seed=3)
    engine.add_request(
        GenerateRequest(
            "slow", prompts[0], SamplingParams(max_new_tokens=8, temperature=0.0, grammar=slow)
        )
    )  # noqa: E501
    engine.add_request(
        GenerateRequest(
            "free", prompts[1], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        )
    )  # noqa: E501
    done = {}
    for _ in range(50):
        done.update((r.rid, r) for r in engine.step())
        if "free" in done:
            break
    assert set(done) == {"free"}
    assert not engine.scheduler.waiting and engine.structured.num_compiling == 1
    pending.set_result(real(slow).result())
    for _ in range(50):
        if not engine.has_work:
            break
        done.update((r.rid, r) for r in engine.step())
    check_valid(engine, slow, done["slow"])
    assert done["slow"].finish_reason == "stop"


def test_spec_that_does_not_compile_aborts_its_request_only(model_dir):
    engine = make_engine(model_dir)
    bad = SamplingParams(max_new_tokens=8, grammar=GrammarSpec("regex", "a(b"), n=2)
    prompts = random_prompts(2, seed=4)
    out = run(
        engine,
        [GenerateRequest("bad", prompts[0], bad), GenerateRequest("ok", prompts[1], GREEDY)],
    )
    for i in range(2):
        assert out["bad", i].finish_reason == "abort"
        assert "invalid regex" in out["bad", i].error and "parenthesis" in out["bad", i].error
    assert out["ok", 0].finish_reason in ("stop", "length") and out["ok", 0].error is None


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_rejected_token_aborts_that_request_only(model_dir, monkeypatch, overlap, shards):
    """The matchers accept on the fill job; if one refuses a token its bitmask allowed (a bug,
    made up here), that request ends `abort` at that token and the rest are untouched. Also
    with the job in shards (the rejection comes from whichever part holds the request)."""
    reqs = workload(9)
    expected = run(make_engine(model_dir, overlap=overlap), reqs)
    engine = make_engine(model_dir, overlap=overlap)
    if shards > 1:
        sharded(engine, monkeypatch, shards)
    real = engine.grammar.accept_tokens
    victim = next(r.rid for r in reqs if r.params.grammar is not None)
    seen = {"n": 0}

    def accept(matchers, tokens):
        ok = real(matchers, tokens)
        ok = [True] * len(matchers) if ok is None else list(ok)
        for i, m in enumerate(matchers):
            if m is victim_matcher():
                seen["n"] += 1
                if seen["n"] == 3:  # the victim's third output token
                    m.rollback(1)
                    ok[i] = False
        return ok

    def victim_matcher():
        for req in engine.scheduler.running:
            if req.rid == victim:
                return req.matcher
        return None

    monkeypatch.setattr(engine.grammar, "accept_tokens", accept)
    out = run(engine, reqs)
    bad = out[victim, 0]
    assert bad.finish_reason == "abort" and "rejected sampled token" in bad.error
    assert bad.output_ids == expected[victim, 0].output_ids[:3]
    for key, res in out.items():
        if key[0] != victim:
            assert res.output_ids == expected[key].output_ids, key


def test_a_rejection_for_a_retracted_request_drops_it_from_the_queue(model_dir):
    """Without overlap a token waits for the next fill job; the request may be retracted
    meanwhile. Its rejection then takes it off the waiting queue (it holds no KV)."""
    engine = make_engine(model_dir, overlap=False)
    params = SamplingParams(max_new_tokens=32, temperature=0.0, grammar=LONG)
    prompt = random_prompts(1, seed=8)[0]
    engine.add_request(GenerateRequest("r", prompt, params))
    while not (engine.scheduler.running and engine.scheduler.running[0].output_ids[2:]):
        assert not engine.step()
    req = engine.scheduler.running[0]
    engine.scheduler._retract(req)
    engine._rejected.append((req, 1, req.output_ids[1]))
    engine._abort_rejected()
    (res,) = engine._take_finished()
    assert res.finish_reason == "abort" and res.output_ids == req.output_ids[:2]
    assert not engine.scheduler.waiting and not engine.has_work
    engine.check_integrity()
