"""Single tokens of a tokenizer's vocabulary, looked up by their text."""

from __future__ import annotations

from typing import Any


def token_id(tokenizer: Any, text: str) -> int | None:
    """The id of the one token spelled `text` (a special or added token, or a vocabulary
    entry), or None when the vocabulary has no such single token. A lookup of one token, not
    of the whole vocabulary: cheap enough for every batch of rows."""
    to_id = getattr(tokenizer, "convert_tokens_to_ids", None)
    if to_id is None:
        return None
    i = to_id(text)
    if not isinstance(i, int) or tokenizer.convert_ids_to_tokens(i) != text:
        return None  # an unknown token maps to the unknown token's id (or to None)
    return i


def token_ids(tokenizer: Any, *texts: str) -> tuple[int, ...] | None:
    """Ids of several single tokens; None unless every one is in the vocabulary."""
    ids = [token_id(tokenizer, t) for t in texts]
    return None if any(i is None for i in ids) else tuple(ids)  # type: ignore[return-value]


def encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    """`text` as ids, without BOS or other added tokens."""
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids that a decode with ``skip_special_tokens=True`` leaves out: the named special
    tokens and the added tokens marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    named = getattr(tokenizer, "all_special_ids", ()) or ()
    return frozenset(named) | {i for i, t in added.items() if getattr(t, "special", False)}
