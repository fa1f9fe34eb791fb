"""Stop strings: detect them while decoding, and cut the final text before them (as OpenAI does).

Detection decodes only a window of the last tokens (enough to hold the longest stop string), so a
step costs O(window) per request with stop strings, never O(output length).
"""

from __future__ import annotations

from batchrun.engine.request import Req

# extra tokens beyond one-char-per-token, for byte-fallback tokens that form a character together
_WINDOW_MARGIN = 8


class StopStringChecker:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def find(self, req: Req, num_out: int | None = None) -> str | None:
        """The stop string that output token num_out - 1 (default: the newest) completed."""
        stops = req.params.stop
        window = max(len(s) for s in stops) + _WINDOW_MARGIN
        ids = req.output_ids if num_out is None else req.output_ids[:num_out]
        tail = self.tokenizer.decode(ids[-window:], skip_special_tokens=True)
        # NOTE: only matches that end in the newest token's text count; an older one was passed
        # over while min_new_tokens held stops back, and must not end the request now. The old
        # text is the common prefix: a byte-fallback character may have been completed just now.
        old = self.tokenizer.decode(ids[-window:-1], skip_special_tokens=True)
        num_old = next(
            (i for i, (a, b) in enumerate(zip(old, tail, strict=False)) if a != b), len(old)
        )
        hits = []
        for s in stops:
            at = tail.find(s, max(0, num_old - len(s) + 1))
            if at >= 0:
                hits.append((at, s))
        return min(hits)[1] if hits else None


def cut_at_stop(text: str, stops: tuple[str, ...], matched: str | None = None) -> str:
    """Text up to (not including) the earliest stop string. Pass the result's `matched_stop` to
    cut before its last occurrence instead: with min_new_tokens, earlier stop strings may have
    been passed over."""
    if matched is not None:
        cut = text.rfind(matched)
    else:
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]
