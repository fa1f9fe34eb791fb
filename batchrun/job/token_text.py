"""The text of single tokens, for logprobs records (OpenAI's `logprobs.content[].token`).

A token's text is what the tokenizer decodes it to alone: special tokens kept, no clean-up of
spaces (" ." stays " ."); a token that holds part of a multi-byte character decodes to U+FFFD
(the records carry no raw bytes). Texts are decoded in one batched call per record for the ids
not seen yet and kept, so a run decodes each distinct token id once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


class TokenTexts:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def prepare(self, token_ids: Iterable[int]) -> Callable[[int], str]:
        """Decode, in one batch, the ids among `token_ids` not decoded yet; returns the lookup
        of every id decoded so far (a plain dict lookup: KeyError for an id never prepared)."""
        texts = self._texts
        missing = list(set(token_ids).difference(texts))
        if missing:
            decoded = self.tokenizer.batch_decode(
                [[t] for t in missing],
                skip_special_tokens=False,
                clean_up_tokenization_spaces=False,
            )
            texts.update(zip(missing, decoded))
        return texts.__getitem__

    def __len__(self) -> int:
        return len(self._texts)
