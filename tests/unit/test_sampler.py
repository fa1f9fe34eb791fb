from __future__ import annotations

import math

import pytest
import torch

from batchrun.engine.penalties import PenaltyState, apply_penalties
from batchrun.engine.sampler import SampleOutput, Sampler, SamplingBatch, row_keys, uniforms
from batchrun.params import SamplingParams

NUM_DRAWS = 20_000
# The RNG is a deterministic hash, so these tests cannot flake; the bounds are still the ones a
# true sampler would pass with probability 1 - 1e-6, so a biased sampler fails them.
MIN_P_VALUE = 1e-6
MAX_TV = 0.02

# Probabilities chosen so that no token sits on a top-p / min-p boundary.
PROBS = torch.tensor([0.30, 0.22, 0.15, 0.11, 0.08, 0.06, 0.04, 0.025, 0.015, 0.01])
LOGITS = PROBS.log() + 1.7  # an offset that softmax removes


def make_batch(
    params: list[SamplingParams],
    vocab_size: int,
    seeds: list[int] | None = None,
    steps: list[int] | None = None,
    rows: list[int] | None = None,
    eos_token_ids: tuple[int, ...] = (),
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        seeds=list(range(n)) if seeds is None else seeds,
        steps=[0] * n if steps is None else steps,
        rows=list(range(n)) if rows is None else rows,
        vocab_size=vocab_size,
        eos_token_ids=list(eos_token_ids),
        device="cpu",
    )


def draw(params: SamplingParams, logits: torch.Tensor = LOGITS, n: int = NUM_DRAWS) -> torch.Tensor:
    """n draws for one request: the same logits in n rows with seeds 0..n-1."""
    batch = make_batch([params] * n, logits.numel())
    return Sampler()(logits.expand(n, -1), batch, None).next_token_ids


def check_distribution(tokens: torch.Tensor, target: torch.Tensor) -> None:
    """Chi-square goodness of fit plus a total-variation bound; zero-prob tokens never appear."""
    counts = torch.bincount(tokens, minlength=target.numel()).double()
    target = target.double() / target.sum()
    allowed = target > 0
    assert counts[~allowed].sum() == 0, f"tokens outside the allowed set: {counts}"
    expected = target[allowed] * tokens.numel()
    chi2 = ((counts[allowed] - expected) ** 2 / expected).sum()
    dof = int(allowed.sum()) - 1
    if dof > 0:
        p_value = torch.special.gammaincc(torch.tensor(dof / 2.0), chi2 / 2.0).item()
        assert p_value > MIN_P_VALUE, f"chi2={chi2:.1f} dof={dof} p={p_value:.2e}"
    tv = 0.5 * (counts / tokens.numel() - target).abs().sum().item()
    assert tv < MAX_TV, f"total variation {tv:.4f}"


def test_temperature_matches_softmax() -> None:
    for temperature in (1.0, 0.5, 2.0):
        tokens = draw(SamplingParams(temperature=temperature))
        check_distribution(tokens, torch.softmax(LOGITS / temperature, dim=-1))


def test_top_k_renormalizes_over_k_best() -> None:
    target = PROBS.clone()
    target[4:] = 0
    check_distribution(draw(SamplingParams(top_k=4)), target)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Smallest set (by descending prob) whose cumulative prob reaches top_p, renormalized."""
    order = sorted(range(probs.numel()), key=lambda i: -float(probs[i]))
    out, total = torch.zeros_like(probs), 0.0
    for i in order:
        out[i] = probs[i]
        total += float(probs[i])
        if total >= top_p:
            break
    return out


@pytest.mark.parametrize("top_p", [0.5, 0.8, 0.95])
def test_top_p_keeps_the_nucleus(top_p: float) -> None:
    check_distribution(draw(SamplingParams(top_p=top_p)), nucleus(PROBS, top_p))


def test_min_p_keeps_tokens_above_fraction_of_max() -> None:
    target = torch.where(PROBS >= 0.25 * PROBS.max(), PROBS, torch.zeros_like(PROBS))
    check_distribution(draw(SamplingParams(min_p=0.25)), target)


def test_temperature_top_k_top_p_min_p_in_order() -> None:
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.9, min_p=0.1)
    probs = torch.softmax(LOGITS.double() / 0.7, dim=-1)
    probs[probs.argsort(descending=True)[6:]] = 0  # top-k
    probs = nucleus(probs / probs.sum(), 0.9)  # top-p on the renormalized top-k set
    probs = torch.where(probs >= 0.1 * probs.max(), probs, torch.zeros_like(probs))  # min-p
    check_distribution(draw(params), probs)


def test_steps_are_independent_draws() -> None:
    # Same seed, consecutive steps: the pair (token at s, token at s + 1) is uniform on 4 x 4.
    n, vocab_size = NUM_DRAWS, 4
    logits = torch.zeros(n, vocab_size)
    first = Sampler()(logits, make_batch([SamplingParams()] * n, vocab_size), None)
    second_batch = make_batch([SamplingParams()] * n, vocab_size, steps=[1] * n)
    second = Sampler()(logits, second_batch, None)
    pairs = first.next_token_ids * vocab_size + second.next_token_ids
    check_distribution(pairs, torch.ones(vocab_size * vocab_size))
    # And one seed across many steps samples the distribution too.
    steps = list(range(n))
    batch = make_batch([SamplingParams()] * n, LOGITS.numel(), seeds=[7] * n, steps=steps)
    tokens = Sampler()(LOGITS.expand(n, -1), batch, None).next_token_ids
    check_distribution(tokens, PROBS)


def test_greedy_is_argmax_in_mixed_batch() -> None:
    torch.manual_seed(0)
    vocab_size = 300
    logits = torch.randn(8, vocab_size).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(top_k=1),
        SamplingParams(temperature=0.0, top_k=5, top_p=0.1, min_p=0.5),  # filters ignored
    ] * 2
    out = Sampler()(logits, make_batch(params, vocab_size), None)
    expected = logits.float().argmax(dim=-1)
    greedy = torch.tensor([p.is_greedy for p in params])
    assert torch.equal(out.next_token_ids[greedy], expected[greedy])
    assert out.next_token_ids.dtype == torch.int64 and out.logprobs is None


def test_same_seed_and_step_same_token_whatever_the_batch() -> None:
    torch.manual_seed(1)
    vocab_size, n = 50, 200
    logits = torch.randn(n, vocab_size)
    params = SamplingParams(temperature=0.9)
    seeds, steps = list(range(1000, 1000 + n)), [i % 17 for i in range(n)]
    alone = torch.cat(
        [
            Sampler()(
                logits[i : i + 1], make_batch([params], vocab_size, [seeds[i]], [steps[i]]), None
            ).next_token_ids
            for i in range(n)
        ]
    )
    together = Sampler()(logits, make_batch([params] * n, vocab_size, seeds, steps), None)
    assert torch.equal(alone, together.next_token_ids)
    # In a batch with greedy, top-k / top-p / min-p and penalized rows (sort and min-p paths).
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3, top_p=0.7),
        SamplingParams(min_p=0.3, repetition_penalty=1.3, frequency_penalty=0.5),
    ]
    state = PenaltyState(max_rows=n + 3, vocab_size=vocab_size, device="cpu")
    for row in range(n + 3):
        state.reset_row(row, [1, 2, 3], [4])
    mixed = make_batch(others + [params] * n, vocab_size, [5, 6, 7] + seeds, [0, 0, 0] + steps)
    out = Sampler()(torch.cat([torch.randn(3, vocab_size), logits]), mixed, state)
    assert torch.equal(out.next_token_ids[3:], together.next_token_ids)


def test_different_seeds_give_different_streams() -> None:
    vocab_size, n = 1000, 64
    logits = torch.zeros(n, vocab_size)
    params = [SamplingParams()] * n

    def stream(seed: int) -> torch.Tensor:
        batch = make_batch(params, vocab_size, seeds=[seed] * n, steps=list(range(n)))
        return Sampler()(logits, batch, None).next_token_ids

    assert torch.equal(stream(3), stream(3))
    for a, b in [(3, 4), (0, 1 << 32), (-1, 1 << 63), (12345, 12346)]:
        assert (stream(a) != stream(b)).float().mean() > 0.9


def penalized_reference(
    logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams
) -> torch.Tensor:
    out = logits.clone()
    for tok in set(prompt) | set(output):
        if params.repetition_penalty != 1.0:
            value = out[tok]
            if value > 0:
                out[tok] = value / params.repetition_penalty
            else:
                out[tok] = value * params.repetition_penalty
    for tok in set(output):
        out[tok] -= params.frequency_penalty * output.count(tok)
        out[tok] -= params.presence_penalty
    return out


def test_penalties_match_reference_formula() -> None:
    torch.manual_seed(2)
    vocab_size = 40
    cases = [
        (SamplingParams(temperature=0.0, repetition_penalty=1.5), [1, 2, 2, 9], [3, 9, 9]),
        (SamplingParams(temperature=0.0, frequency_penalty=0.7), [5], [6, 6, 6, 7]),
        (SamplingParams(temperature=0.0, presence_penalty=-1.2), [], [8, 8, 30]),
        (
            SamplingParams(
                temperature=0.0,
                repetition_penalty=0.8,
                frequency_penalty=0.3,
                presence_penalty=0.4,
            ),
            [0, 1, 2],
            [2, 3, 3, 39],
        ),
        (SamplingParams(temperature=0.0), [1, 2, 3], [4, 5]),  # neutral row: logits untouched
    ]
    # Rows 4..8: the scheduler resets them from the prompt and the first output token, then the
    # rest of the output arrives through update() one step at a time.
    rows = [4, 5, 6, 7, 8]
    state = PenaltyState(max_rows=10, vocab_size=vocab_size, device="cpu")
    assert not state.is_allocated
    state.update(torch.tensor(rows), torch.zeros(5, dtype=torch.int64))  # no-op before allocation
    for row, (_, prompt, output) in zip(rows, cases, strict=True):
        state.reset_row(row, prompt, output[:1])
    for step in range(1, 4):
        active = [
            (row, out[step])
            for row, (_, _, out) in zip(rows, cases, strict=True)
            if step < len(out)
        ]
        state.update(torch.tensor([r for r, _ in active]), torch.tensor([t for _, t in active]))

    logits = torch.randn(len(cases), vocab_size) * 3
    params = [p for p, _, _ in cases]
    expected = torch.stack(
        [penalized_reference(logits[i], c[1], c[2], c[0]) for i, c in enumerate(cases)]
    )
    batch = make_batch(params, vocab_size, rows=rows)
    got = apply_penalties(
        logits,
        state,
        batch.rows,
        batch.repetition_penalties,
        batch.frequency_penalties,
        batch.presence_penalties,
        batch.has_repetition,
        batch.has_frequency_presence,
    )
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[4], logits[4])
    # Through the sampler: greedy rows pick the argmax of the penalized logits.
    out = Sampler()(logits, batch, state)
    assert torch.equal(out.next_token_ids, expected.argmax(dim=-1))


def test_penalties_change_the_greedy_choice() -> None:
    vocab_size = 5
    logits = torch.tensor([[3.0, 2.5, 0.0, 0.0, 0.0]])
    state = PenaltyState(max_rows=1, vocab_size=vocab_size, device="cpu")
    state.reset_row(0, prompt_ids=[0], output_ids=[])
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5)]  # 3 / 1.5 = 2 < 2.5
    out = Sampler()(logits, make_batch(params, vocab_size), state)
    assert out.next_token_ids.tolist() == [1]
    with pytest.raises(ValueError):
        Sampler()(logits, make_batch(params, vocab_size), None)


def test_min_new_tokens_masks_eos_and_stop_ids() -> None:
    vocab_size, eos = 20, 0
    logits = torch.full((6, vocab_size), -5.0)
    logits[:, eos] = 10.0
    logits[:, 7] = 9.0  # a stop id
    logits[:, 3] = 1.0
    params = [
        SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=(7,)),
        SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=(7,)),
        SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=(7,)),
        SamplingParams(temperature=0.0, ignore_eos=True),  # may still pick EOS
        SamplingParams(temperature=5.0, min_new_tokens=3, stop_token_ids=(7, 7)),
        SamplingParams(temperature=0.0, min_new_tokens=1),
    ]
    steps = [0, 1, 2, 0, 0, 0]
    batch = make_batch(params, vocab_size, steps=steps, eos_token_ids=(eos,))
    assert batch.banned is not None
    out = Sampler()(logits, batch, None).next_token_ids.tolist()
    assert out[0] == 3 and out[1] == 3 and out[2] == eos and out[3] == eos and out[5] == 7
    # Sampled rows never pick a masked id, over many seeds.
    n = 2000
    many = make_batch([params[4]] * n, vocab_size, eos_token_ids=(eos, 1))
    tokens = Sampler()(logits[4:5].expand(n, -1), many, None).next_token_ids
    assert not torch.isin(tokens, torch.tensor([eos, 1, 7])).any()


def test_greedy_with_banned_ids_leaves_the_logits_as_they_came() -> None:
    """A greedy batch that bans ids (min_new_tokens) takes its argmax without copying the
    logits: the banned entries are -inf only for the argmax, and the caller's tensor ends as it
    came. An expanded (overlapping) view takes the out-of-place fill."""
    torch.manual_seed(5)
    vocab_size, eos = 50, 4
    with torch.inference_mode():  # as a CUDA graph's logits are
        logits = torch.randn(5, vocab_size)
        logits[:, eos] = 9.0
        logits[:, 11] = 8.0  # a stop id, banned in rows 0-1 (row 2 is past min_new_tokens)
    params = [SamplingParams(temperature=0.0, min_new_tokens=3, stop_token_ids=(11, eos))] * 3
    params += [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, min_new_tokens=1)]
    batch = make_batch(params, vocab_size, steps=[0, 1, 3, 0, 0], eos_token_ids=(eos,))
    assert batch.all_greedy and batch.banned is not None and not batch.is_plain_greedy
    before = logits.clone()
    out = Sampler()(logits, batch, None).next_token_ids.tolist()
    assert torch.equal(Sampler()(before, batch, None).next_token_ids, torch.tensor(out))
    masked = logits.clone()
    masked[:2, [eos, 11]] = float("-inf")
    masked[4, eos] = float("-inf")
    assert out == masked.argmax(-1).tolist()
    assert out[2] == eos and out[3] == eos and out[4] == 11
    assert torch.equal(logits, before)
    row = logits[0:1].expand(3, -1)
    same = make_batch([params[0]] * 3, vocab_size, eos_token_ids=(eos,))
    assert Sampler()(row, same, None).next_token_ids.tolist() == [masked[0].argmax().item()] * 3
    assert torch.equal(logits, before)


def test_logprobs_are_of_the_raw_distribution() -> None:
    torch.manual_seed(3)
    vocab_size = 64
    logits = (torch.randn(4, vocab_size) * 2).half()
    params = [
        SamplingParams(temperature=0.0, logprobs=True, repetition_penalty=2.0),
        SamplingParams(temperature=0.5, top_k=10, top_logprobs=5),
        SamplingParams(temperature=1.3, top_p=0.9, min_p=0.05, logprobs=True, top_logprobs=2),
        SamplingParams(),
    ]
    state = PenaltyState(max_rows=4, vocab_size=vocab_size, device="cpu")
    for row in range(4):
        state.reset_row(row, list(range(0, vocab_size, 2)), [])
    out = Sampler()(logits, make_batch(params, vocab_size), state)
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs is not None and out.top_logprob_ids is not None
    assert out.top_logprob_vals is not None
    assert torch.equal(out.logprobs, raw.gather(1, out.next_token_ids[:, None]).squeeze(1))
    top_vals, top_ids = torch.topk(raw, 5, dim=-1)
    assert torch.equal(out.top_logprob_ids, top_ids) and torch.equal(out.top_logprob_vals, top_vals)
    assert out.logprobs.dtype == torch.float32 and out.top_logprob_ids.shape == (4, 5)


def test_flags_skip_work() -> None:
    greedy = make_batch([SamplingParams(temperature=0.0, top_p=0.5)] * 2, 100)
    assert greedy.all_greedy and not greedy.needs_sort and not greedy.needs_min_p
    assert not greedy.has_penalties and not greedy.needs_logprobs and greedy.banned is None
    plain = make_batch([SamplingParams(), SamplingParams(top_k=100, top_p=1.0)], 100)
    assert not plain.all_greedy and not plain.any_greedy and not plain.needs_sort
    sort = make_batch([SamplingParams(temperature=0.0), SamplingParams(top_k=99)], 100)
    assert sort.needs_sort and sort.any_greedy
    assert make_batch([SamplingParams(top_logprobs=3)], 100).num_top_logprobs == 3


Inputs = tuple[Sampler, torch.Tensor, SamplingBatch, PenaltyState]


def prepare(device: str) -> Inputs:
    """A batch that takes every path: penalties, masks, sort, min-p, greedy, logprobs."""
    torch.manual_seed(4)
    vocab_size = 128
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, top_logprobs=3),
        SamplingParams(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.5),
        SamplingParams(temperature=1.0, min_new_tokens=4, stop_token_ids=(5,)),
    ]
    state = PenaltyState(max_rows=8, vocab_size=vocab_size, device=device)
    for row in range(4):
        state.reset_row(row, [1, 2, 3], [4, 4])
    batch = SamplingBatch.build(
        params, [11, 12, 13, 14], [2, 2, 2, 2], [0, 1, 2, 3], vocab_size, [0], device
    )
    logits = torch.randn(4, vocab_size).to(device)
    sampler = Sampler()
    sampler.vocab_hash(vocab_size, torch.device(device))  # filled once per vocab, off the hot path
    return sampler, logits, batch, state


def step(inputs: Inputs) -> SampleOutput:
    """One hot-path step: sample, then count the sampled tokens."""
    sampler, logits, batch, state = inputs
    out = sampler(logits, batch, state)
    state.update(batch.rows, out.next_token_ids)
    return out


def test_no_host_sync_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("host sync in the sampler")

    expected = step(prepare("cpu"))
    inputs = prepare("cpu")  # SamplingBatch.build and reset_row run on the host by design
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    monkeypatch.setattr(torch, "nonzero", forbidden)
    monkeypatch.setattr(torch, "masked_select", forbidden)
    got = step(inputs)
    monkeypatch.undo()
    assert torch.equal(got.next_token_ids, expected.next_token_ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_sync_on_cuda_and_same_tokens_as_cpu() -> None:
    cpu = step(prepare("cpu"))
    step(prepare("cuda"))  # warm-up: lazy CUDA init may sync
    inputs = prepare("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = step(inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out.next_token_ids.cpu(), cpu.next_token_ids)


def test_uniforms_never_hit_zero_or_one() -> None:
    keys = row_keys(torch.arange(-50, 50), torch.arange(100))
    u = uniforms(keys, Sampler().vocab_hash(50_000, torch.device("cpu")))
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 1e-3
    assert math.isclose(u.var().item(), 1 / 12, rel_tol=1e-2)


def test_shared_params_columns_equal_row_by_row():
    from batchrun.engine.sampler import _columns, _columns_shared
    from batchrun.params import SamplingParams

    for p in (
        SamplingParams(temperature=0.0, min_new_tokens=3, stop_token_ids=(7, 2)),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.2),
    ):
        args = ([1, 2**63 + 5, 3], [0, 3, 2], [4, 5, 6], 50, [2, 9])
        assert _columns_shared(p, *args) == _columns([p, p, p], *args)
