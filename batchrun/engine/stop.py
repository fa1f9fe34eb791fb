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

    def find(self, req: Req) -> str | None:
        """The stop string that the newest token completed, if any."""
        stops = req.params.stop
        window = max(len(s) for s in stops) + _WINDOW_MARGIN
        ids = req.output_ids
        tail = self.tokenizer.decode(ids[-window:], skip_special_tokens=True)
        hits = [(tail.find(s), s) for s in stops if s in tail]
        return min(hits)[1] if hits else None


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    """Text up to (not including) the earliest stop string."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]
