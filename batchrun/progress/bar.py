"""The progress line: a tqdm bar on stderr with rows, output tok/s, cached-prompt % and ETA."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
    def __init__(self, total: int | None, quiet: bool, desc: str = "rows"):
        self.start = time.perf_counter()
        self.bar = None
        if not quiet:
            self.bar = tqdm(
                total=total,
                desc=desc,
                unit="row",
                file=sys.stderr,
                dynamic_ncols=True,
                smoothing=0.1,
                mininterval=0.5,
            )
        self._last_postfix = 0.0

    def update(self, rows: int, output_tokens: int, prompt_tokens: int, cached_tokens: int):
        if self.bar is None:
            return
        self.bar.update(rows)
        now = time.perf_counter()
        if now - self._last_postfix >= 0.5:
            self._last_postfix = now
            elapsed = max(now - self.start, 1e-9)
            cached = 100.0 * cached_tokens / prompt_tokens if prompt_tokens else 0.0
            self.bar.set_postfix_str(
                f"{output_tokens / elapsed:,.0f} tok/s, cached {cached:.0f}%", refresh=False
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start
