"""Single tokens of a tokenizer's vocabulary, looked up by their text."""

from __future__ import annotations

from typing import Any


def token_id(tokenizer: Any, text: str) -> int | None:
    """The id of the one token spelled `text` (a special or added token, or a vocabulary
    entry), or None when the vocabulary has no such single token."""
    vocab = tokenizer.get_vocab()
    return vocab.get(text)


def token_ids(tokenizer: Any, *texts: str) -> tuple[int, ...] | None:
    """Ids of several single tokens; None unless every one is in the vocabulary."""
    vocab = tokenizer.get_vocab()
    ids = [vocab.get(t) for t in texts]
    return None if any(i is None for i in ids) else tuple(ids)  # type: ignore[return-value]


def encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    """`text` as ids, without BOS or other added tokens."""
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids that a decode with ``skip_special_tokens=True`` leaves out."""
    return frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
