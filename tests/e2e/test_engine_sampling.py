"""Engine features through the Engine API on a tiny random llama (CPU, fp32): stop token ids, EOS,
min/max_new_tokens, stop strings, logprobs, seeds, penalties, n > 1, and a KV pool too small for a
request. References are greedy runs of the same engine, `engine.score`, or HF transformers."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_tiny_model, random_prompts  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine, derive_seed  # noqa: E402
from batchrun.engine.stop import cut_at_stop  # noqa: E402
from batchrun.params import GenerateRequest, GenerateResult, SamplingParams  # noqa: E402

VOCAB = 256
PROMPT = [5, 17, 42, 99, 7, 130, 64, 3, 250, 18, 77, 201]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


def save_char_tokenizer(path: Path) -> None:
    """A fast tokenizer that maps id i to the one character chr(0x4E00 + i), so that decoded text
    splits back into tokens exactly and a stop string can be placed on token boundaries."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(0x4E00 + i): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=chr(0x4E00)))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf = make_tiny_model("llama", path)
    save_char_tokenizer(path)
    return path, hf


def make_engine(path: Path, **overrides) -> Engine:
    cfg = dict(model=str(path), device="cpu", dtype="float32", kv_budget=8192)
    return Engine(EngineConfig(**{**cfg, **overrides}))


@pytest.fixture(scope="module")
def engine(tiny):
    return make_engine(tiny[0])


def run(engine: Engine, *reqs: GenerateRequest) -> dict[tuple[str, int], GenerateResult]:
    """All results by (rid, index); a bounded step loop, so that a stuck engine fails the test
    instead of hanging it."""
    for req in reqs:
        engine.add_request(req)
    out = {}
    for _ in range(10_000):
        if not engine.has_work:
            break
        out.update(((r.rid, r.index), r) for r in engine.step())
    assert not engine.has_work, "the engine stopped making progress"
    engine.check_integrity()
    return out


def run_one(engine: Engine, params: SamplingParams, prompt=PROMPT, rid="r") -> GenerateResult:
    results = run(engine, GenerateRequest(rid, list(prompt), params))
    assert len(results) == 1
    return results[rid, 0]


@pytest.fixture(scope="module")
def reference(engine) -> list[int]:
    """Greedy output of PROMPT; the model has no EOS, so it always runs to the length limit."""
    res = run_one(engine, GREEDY)
    assert res.finish_reason == "length" and len(res.output_ids) == GREEDY.max_new_tokens
    return res.output_ids


def first_new_token_at(ids: list[int], start: int) -> int:
    """The first step k >= start whose greedy token did not appear before it."""
    return next(k for k in range(start, len(ids)) if ids[k] not in ids[:k])


# -- stop token ids, EOS, min/max_new_tokens -------------------------------------------------


def test_stop_token_id_ends_the_request(engine, reference):
    k = first_new_token_at(reference, 5)
    stop_id = reference[k]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=(stop_id,))
    res = run_one(engine, params)
    assert res.output_ids == reference[: k + 1]  # the stop token is part of the output
    assert (res.finish_reason, res.matched_stop) == ("stop", stop_id)
    assert res.completion_tokens == k + 1 and res.prompt_tokens == len(PROMPT)


def test_min_new_tokens_holds_back_stop_token(engine, reference):
    k = first_new_token_at(reference, 5)
    stop_id = reference[k]
    min_new = k + 3
    params = SamplingParams(
        max_new_tokens=24, min_new_tokens=min_new, temperature=0.0, stop_token_ids=(stop_id,)
    )
    res = run_one(engine, params)
    assert (
        res.output_ids[:k] == reference[:k]
    )  # masking a token greedy did not pick changes nothing
    assert stop_id not in res.output_ids[:min_new]
    assert len(res.output_ids) >= min_new
    if res.finish_reason == "stop":
        assert res.output_ids[-1] == res.matched_stop == stop_id
    else:
        assert res.finish_reason == "length" and len(res.output_ids) == 24


def test_max_new_tokens_gives_length(engine, reference):
    res = run_one(engine, SamplingParams(max_new_tokens=7, temperature=0.0))
    assert res.output_ids == reference[:7]
    assert res.finish_reason == "length" and res.matched_stop is None


def test_eos_ends_unless_ignore_eos(tiny, reference, tmp_path):
    k = first_new_token_at(reference, 4)
    eos = reference[k]
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny[0] / name, tmp_path / name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [eos, 2]}))
    engine = make_engine(tmp_path)
    assert engine.eos_token_ids == (eos, 2)

    res = run_one(engine, SamplingParams(max_new_tokens=24, temperature=0.0))
    assert res.output_ids == reference[: k + 1]
    assert (res.finish_reason, res.matched_stop) == ("stop", eos)

    res = run_one(engine, GREEDY)  # ignore_eos=True
    assert res.output_ids == reference and res.finish_reason == "length"

    res = run_one(engine, SamplingParams(max_new_tokens=24, min_new_tokens=k + 2, temperature=0.0))
    assert res.output_ids[:k] == reference[:k]
    assert eos not in res.output_ids[: k + 2] and len(res.output_ids) >= k + 2


# -- stop strings ----------------------------------------------------------------------------


def first_new_pair_at(ids: list[int], start: int) -> int:
    """The first k >= start whose pair (ids[k], ids[k+1]) does not occur earlier."""
    pairs = list(zip(ids, ids[1:], strict=False))
    return next(k for k in range(start, len(pairs)) if pairs[k] not in pairs[:k])


def test_stop_string_ends_and_is_cut(engine, reference):
    tok = engine.tokenizer
    k = first_new_pair_at(reference, 4)
    stop = tok.decode(reference[k : k + 2])
    assert len(stop) == 2
    params = SamplingParams(max_new_tokens=24, temperature=0.0, stop=("never-seen", stop))
    res = run_one(engine, params)
    assert res.output_ids == reference[: k + 2]
    assert (res.finish_reason, res.matched_stop) == ("stop", stop)
    text = tok.decode(res.output_ids)
    expected = tok.decode(reference[:k])  # OpenAI semantics: the stop string is not returned
    assert cut_at_stop(text, params.stop) == expected
    assert cut_at_stop(text, params.stop, matched=res.matched_stop) == expected


def test_earliest_stop_string_wins(engine, reference):
    tok = engine.tokenizer
    k = first_new_pair_at(reference, 6)
    # both complete at step k+1; the one that starts earlier is reported and cut at
    longer, shorter = tok.decode(reference[k - 1 : k + 2]), tok.decode(reference[k + 1])
    params = SamplingParams(max_new_tokens=24, temperature=0.0, stop=(shorter, longer))
    res = run_one(engine, params)
    if reference[k + 1] in reference[: k + 1]:
        pytest.skip("the shorter stop string occurs earlier in this model's output")
    assert res.output_ids == reference[: k + 2] and res.matched_stop == longer
    assert cut_at_stop(tok.decode(res.output_ids), params.stop) == tok.decode(reference[: k - 1])


def test_min_new_tokens_passes_over_an_earlier_stop_string(engine, reference):
    """A stop string generated before min_new_tokens is passed over; the request ends at its next
    occurrence, and the text is cut there (vLLM semantics), not at the early one."""
    tok = engine.tokenizer
    # a token that recurs, not right after its first occurrence: [.. t x .. t ..]
    first, again = next(
        (i, j)
        for j, t in enumerate(reference)
        for i in [reference.index(t)]
        if j > i + 1 and reference[i + 1] != t
    )
    stop = tok.decode([reference[first]])
    params = SamplingParams(
        max_new_tokens=24, min_new_tokens=first + 2, temperature=0.0, stop=(stop,)
    )
    res = run_one(engine, params)
    assert res.output_ids == reference[: again + 1]  # stop strings mask nothing: still greedy
    assert (res.finish_reason, res.matched_stop) == ("stop", stop)
    text = tok.decode(res.output_ids)
    assert cut_at_stop(text, params.stop, matched=stop) == tok.decode(reference[:again])


# -- logprobs --------------------------------------------------------------------------------


def test_logprobs_match_teacher_forced_scores(engine):
    params = SamplingParams(max_new_tokens=12, temperature=0.0, logprobs=True, top_logprobs=5)
    res = run_one(engine, params)
    assert len(res.logprobs) == len(res.top_logprobs) == 12
    for k, token in enumerate(res.output_ids):
        ref = torch.log_softmax(engine.score(PROMPT + res.output_ids[:k])[-1].float(), dim=-1)
        assert abs(res.logprobs[k] - ref[token].item()) <= 1e-4, f"step {k}"
        vals, ids = torch.topk(ref, 5)
        top = res.top_logprobs[k]
        assert top.token_ids == ids.tolist(), f"step {k}"
        assert torch.allclose(torch.tensor(top.logprobs), vals, atol=1e-4), f"step {k}"
        assert top.token_ids[0] == token  # greedy picks the most likely token
    engine.check_integrity()


def test_logprobs_are_of_the_raw_distribution_under_penalties(engine):
    params = SamplingParams(
        max_new_tokens=8, temperature=0.0, repetition_penalty=2.0, logprobs=True, top_logprobs=1
    )
    res = run_one(engine, params)
    for k, token in enumerate(res.output_ids):
        ref = torch.log_softmax(engine.score(PROMPT + res.output_ids[:k])[-1], dim=-1)
        assert abs(res.logprobs[k] - ref[token].item()) <= 1e-4


# -- seeds -----------------------------------------------------------------------------------


def sampled(seed: int | None, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=16, temperature=1.0, seed=seed, ignore_eos=True, **kw)


def noise_requests(num: int) -> list[GenerateRequest]:
    """Random prompts with a mix of greedy, sampled, top-k/top-p and penalized params."""
    kinds = [
        SamplingParams(max_new_tokens=10, temperature=0.0),
        SamplingParams(max_new_tokens=20, temperature=0.7, top_k=20),
        SamplingParams(max_new_tokens=6, temperature=1.2, top_p=0.8, seed=11),
        SamplingParams(max_new_tokens=14, temperature=0.9, frequency_penalty=0.5),
    ]
    prompts = random_prompts(num, seed=5)
    return [GenerateRequest(f"noise{i}", p, kinds[i % 4]) for i, p in enumerate(prompts)]


def test_seeded_sample_does_not_depend_on_the_batch(tiny, engine):
    alone = run_one(engine, sampled(1234), rid="x").output_ids
    reqs = noise_requests(16)
    reqs.insert(7, GenerateRequest("x", PROMPT, sampled(1234)))
    in_batch = {r.rid: r for r in engine.generate(reqs)}["x"].output_ids
    engine.check_integrity()
    serial = run(make_engine(tiny[0], max_running=1), *reqs)["x", 0].output_ids
    assert alone == in_batch == serial
    assert run_one(engine, sampled(1235), rid="x").output_ids != alone
    # the request id does not enter an explicit seed
    assert run_one(engine, sampled(1234), rid="other").output_ids == alone


def test_unseeded_sample_derives_its_seed_from_config_and_rid(tiny, engine):
    first = run_one(engine, sampled(None), rid="abc").output_ids
    assert run_one(engine, sampled(None), rid="abc").output_ids == first
    assert run_one(engine, sampled(derive_seed(0, "abc")), rid="zzz").output_ids == first
    assert run_one(engine, sampled(None), rid="abd").output_ids != first
    assert run_one(make_engine(tiny[0], seed=1), sampled(None), rid="abc").output_ids != first


def test_n_samples_are_distinct(engine):
    params = sampled(7, n=5)
    results = run(engine, GenerateRequest("n", PROMPT, params))
    assert sorted(results) == [("n", i) for i in range(5)]
    outputs = {tuple(r.output_ids) for r in results.values()}
    assert len(outputs) == 5
    assert all(r.completion_tokens == 16 and r.finish_reason == "length" for r in results.values())
    # sample 0 uses the request's seed itself
    assert results["n", 0].output_ids == run_one(engine, sampled(7), rid="n").output_ids


# -- penalties -------------------------------------------------------------------------------


def test_repetition_penalty_matches_hf_generate(tiny, engine):
    _, hf = tiny
    for i, prompt in enumerate([PROMPT, *random_prompts(2, seed=9)]):
        params = SamplingParams(max_new_tokens=32, temperature=0.0, repetition_penalty=1.3)
        ours = run_one(engine, params, prompt=prompt).output_ids
        ids = torch.tensor([prompt])
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
            repetition_penalty=1.3,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert ours == ref, f"prompt {i}"


@torch.no_grad()
def reference_loop(hf, prompt: list[int], n: int, rep=1.0, freq=0.0, pres=0.0) -> list[int]:
    """Greedy with HF forward + penalties: repetition (HF) over prompt and output, frequency and
    presence (OpenAI) over the output."""
    out: list[int] = []
    for _ in range(n):
        logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        seen = torch.zeros(VOCAB, dtype=torch.bool)
        seen[prompt + out] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=VOCAB).float()
        logits = logits - freq * counts - pres * (counts > 0).float()
        out.append(int(logits.argmax()))
    return out


PENALTIES = [
    dict(freq=1.0),
    dict(pres=1.5),
    dict(rep=1.2, freq=0.5, pres=0.5),
    dict(freq=-0.5),
]


def penalized(n: int, rep=1.0, freq=0.0, pres=0.0) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=n,
        temperature=0.0,
        repetition_penalty=rep,
        frequency_penalty=freq,
        presence_penalty=pres,
    )


@pytest.mark.parametrize("overrides", [{}, {"kv_budget": 160, "new_token_ratio": 0.05}])
def test_penalties_match_reference_loop_in_a_batch(tiny, overrides):
    """Each penalized request, batched with plain ones (and retracted when the pool is small),
    equals the step-by-step reference."""
    path, hf = tiny
    engine = make_engine(path, **overrides)
    prompts = random_prompts(len(PENALTIES), seed=13, min_len=8, max_len=30)
    reqs = [
        GenerateRequest(f"p{i}", p, penalized(24, **kw))
        for i, (p, kw) in enumerate(zip(prompts, PENALTIES, strict=True))
    ]
    reqs += noise_requests(6)
    results = run(engine, *reqs)
    if overrides:
        assert engine.scheduler.num_retractions > 0
    for i, (prompt, kw) in enumerate(zip(prompts, PENALTIES, strict=True)):
        assert results[f"p{i}", 0].output_ids == reference_loop(hf, prompt, 24, **kw), kw


def test_frequency_and_presence_penalties_reduce_repeats(engine):
    prompt = random_prompts(1, seed=21)[0]
    plain = run_one(engine, penalized(48), prompt=prompt).output_ids
    freq = run_one(engine, penalized(48, freq=2.0), prompt=prompt).output_ids
    pres = run_one(engine, penalized(48, pres=2.0), prompt=prompt).output_ids
    assert len(set(plain)) < 48, "the unpenalized greedy output should repeat itself"
    assert len(set(freq)) > len(set(plain)) and len(set(pres)) > len(set(plain))


# -- a KV pool too small -----------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 16])
def test_request_larger_than_kv_pool_aborts_alone(tiny, chunk):
    engine = make_engine(tiny[0], kv_budget=64, chunked_prefill_size=chunk)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    small = [GenerateRequest(f"s{i}", list(range(10 + i, 20 + i)), params) for i in range(3)]
    big = GenerateRequest("big", list(range(3, 103)), params)  # 100 prompt tokens > 64 slots
    long_output = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    grow = GenerateRequest("grow", list(range(3, 43)), long_output)
    results = run(engine, small[0], big, small[1], grow, small[2])
    assert results["big", 0].finish_reason == "abort"
    assert results["big", 0].output_ids == []
    assert "--kv-budget" in results["big", 0].error
    # 40 prompt tokens fit, but 40 + 30 new tokens do not: aborted while decoding
    assert results["grow", 0].finish_reason == "abort"
    assert "--kv-budget" in results["grow", 0].error
    for i in range(3):
        assert results[f"s{i}", 0].finish_reason == "length"
        assert results[f"s{i}", 0].completion_tokens == 8 and results[f"s{i}", 0].error is None
