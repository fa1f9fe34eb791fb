"""batchrun.engine.grammar on a made-up vocabulary (no model, no HF tokenizer): the compile
cache, the compiler's messages for bad specs, bitmask filling and applying."""

from __future__ import annotations

import json

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from batchrun.engine import grammar as G  # noqa: E402
from batchrun.params import GrammarSpec  # noqa: E402

# id 0 is the stop token; then single characters and a few longer tokens
CHARS = list('{}[]":, abcdefghijklmnopqrstuvwxyz0123456789-.\\\n') + ['"a"', "true", "yes", "no"]
VOCAB = ["</s>", *CHARS]
EOS = 0
# the logits are wider than the vocabulary (padded vocab): ids beyond it are never allowed
WIDTH = 70


@pytest.fixture
def backend():
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    b = G.GrammarBackend(info, WIDTH, [EOS], max_rows=4, device=torch.device("cpu"))
    yield b
    b.close()


def ids(text: str) -> list[int]:
    """Greedy longest-token encoding of text in VOCAB."""
    out, i = [], 0
    while i < len(text):
        tok = max((t for t in CHARS if text.startswith(t, i)), key=len)
        out.append(VOCAB.index(tok))
        i += len(tok)
    return out


def accepts(backend, spec: GrammarSpec, text: str) -> bool:
    m = backend.matcher(backend.compile(spec).result())
    return all(m.accept_token(t) for t in ids(text)) and m.accept_token(EOS) and m.is_terminated()


def test_cache_compiles_each_spec_once(backend, monkeypatch):
    calls = []
    compile_ = backend._compile
    monkeypatch.setattr(backend, "_compile", lambda spec: calls.append(spec) or compile_(spec))
    a = GrammarSpec("regex", "a+")
    f1, f2 = backend.compile(a), backend.compile(GrammarSpec("regex", "a+"))
    assert f1 is f2
    f1.result()
    assert backend.compile(GrammarSpec("regex", "b+")) is not f1
    backend.compile(GrammarSpec("regex", "b+")).result()
    assert calls == [a, GrammarSpec("regex", "b+")]
    # least recently used entries go first
    monkeypatch.setattr(G, "CACHE_SIZE", 2)
    backend.compile(a)
    backend.compile(GrammarSpec("regex", "c+"))
    assert list(backend._cache) == [a, GrammarSpec("regex", "c+")]


@pytest.mark.parametrize(
    "spec, words",
    [
        (GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "blob"}}})), ["JSON schema", "blob"]),  # noqa: E501
        (GrammarSpec("json_schema", "{not json"), ["JSON schema"]),
        (GrammarSpec("regex", "a(b"), ["regex", "parenthesis"]),
        (GrammarSpec("ebnf", "root ::= missing"), ["EBNF grammar", "missing"]),
    ],
)  # fmt: skip
def test_invalid_specs_raise_the_compilers_message(backend, spec, words):
    with pytest.raises(G.GrammarError) as err:
        backend.compile(spec).result()
    message = str(err.value)
    assert all(w in message for w in words), message
    assert ".cc:" not in message  # no C++ source location
    with pytest.raises(G.GrammarError):
        G.check_spec(spec)
    # the failure is cached too
    assert backend.compile(spec).exception() is not None


def test_kinds_accept_what_they_should(backend):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y"]}},
        "required": ["a", "b"],
    }
    spec = GrammarSpec("json_schema", json.dumps(schema))
    assert accepts(backend, spec, '{"a": true, "b": "y"}')
    assert not accepts(backend, spec, '{"a": 1, "b": "y"}')
    assert accepts(backend, GrammarSpec("json_object"), '{"q": [1, 2]}')
    assert accepts(backend, GrammarSpec("regex", r"\d{2}-[a-c]"), "42-b")
    assert not accepts(backend, GrammarSpec("regex", r"\d{2}-[a-c]"), "42-d")
    assert accepts(backend, GrammarSpec("ebnf", 'root ::= "a" root | "b"'), "aab")
    # choices with characters that need escaping in EBNF
    choices = ['say "yes"', "back\\slash", "two\nlines", "no"]
    spec = GrammarSpec("choice", json.dumps(choices))
    G.check_spec(spec)
    for c in choices:
        assert accepts(backend, spec, c), c
    assert not accepts(backend, spec, "yes")


def test_fill_and_apply_mask(backend):
    spec = GrammarSpec("regex", "[ab]c")
    compiled = backend.compile(spec).result()
    m1, m2 = backend.matcher(compiled), backend.matcher(compiled)
    assert m2.accept_token(VOCAB.index("a"))
    logits = torch.randn(3, WIDTH)
    before = logits.clone()
    mask = backend.fill_mask([m1, m2], [0, 2])  # row 1 is a free request: untouched
    backend.apply(logits, mask)
    allowed = torch.isfinite(logits)
    assert torch.equal(logits[1], before[1])
    assert allowed[0].nonzero().flatten().tolist() == [VOCAB.index("a"), VOCAB.index("b")]
    assert allowed[2].nonzero().flatten().tolist() == [VOCAB.index("c")]
    assert torch.equal(logits[allowed], before[allowed])
    # the torch fallback (CUDA without Triton) agrees with xgrammar's kernel
    again = before.clone()
    vocab = backend.mask_vocab
    assert vocab == len(VOCAB) < WIDTH  # the padding ids are masked apart
    G.apply_mask_torch(again[:, :vocab], mask.bitmask, mask.indices)
    again[[0, 2], vocab:] = float("-inf")
    assert torch.equal(again, logits)
    # after "ac" only the stop token is allowed
    assert m2.accept_token(VOCAB.index("c"))
    logits = torch.zeros(3, WIDTH)
    backend.apply(logits, backend.fill_mask([m2], [1]))
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [EOS]
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()


def test_unpack_bitmask():
    bits = torch.tensor([[0b101, -1], [-(1 << 31), 0]], dtype=torch.int32)  # -1: all 32 bits
    out = G.unpack_bitmask(bits, 40)
    assert out.shape == (2, 40)
    assert out[0, :3].tolist() == [True, False, True] and not out[0, 3:32].any()
    assert out[0, 32:].all() and not out[1, :31].any() and out[1, 31]
    assert not out[1, 32:].any()


def test_choice_ebnf_escapes():
    assert G.choice_ebnf(["a", 'b"c']) == 'root ::= "a" | "b\\"c"'


def test_compiler_message_strips_location():
    e = RuntimeError("[08:38:13] /project/cpp/regex_converter.cc:94: Regex parsing error")
    assert G.compiler_message(e) == "Regex parsing error"


def test_rounds_keep_each_matchers_tokens_in_order():
    from batchrun.engine.structured import _rounds

    a, b = object(), object()
    accepts = [(a, 0, 10), (b, 0, 20), (a, 1, 11), (a, 2, 12), (b, 1, 21)]
    rounds = _rounds(accepts)
    assert rounds == [[(a, 0, 10), (b, 0, 20)], [(a, 1, 11), (b, 1, 21)], [(a, 2, 12)]]
    assert _rounds([]) == []


@pytest.mark.parametrize("wrapper", [False, True])
def test_accept_tokens_flags_only_rejections(backend, monkeypatch, wrapper):
    """accept_tokens: None when every matcher accepts, else a flag per matcher; through the C++
    call or (wrapper) xgrammar's public wrapper."""
    if wrapper:
        monkeypatch.setattr(G, "_core_batch_accept", lambda: None)
    compiled = backend.compile(GrammarSpec("regex", "[ab]c")).result()
    m1, m2, m3 = (backend.matcher(compiled) for _ in range(3))
    a, b, c = (VOCAB.index(ch) for ch in "abc")
    assert backend.accept_tokens([m1, m2], [a, b]) is None
    assert backend.accept_tokens([m1, m2, m3], [c, a, c]) == [True, False, False]
    assert m1.accept_token(EOS) and m1.is_terminated()
