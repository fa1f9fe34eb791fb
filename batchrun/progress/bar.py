"""The progress line: a tqdm bar on stderr with rows, output tok/s (over the last 20 s, and the
attempt's average), cache hits, running / waiting requests and an ETA from tokens (rates.py)."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

from batchrun.params import EngineCounters
from batchrun.progress.rates import RateWindow, eta_seconds

POSTFIX_S = 0.5  # the postfix is recomputed at most this often


class Progress:
    def __init__(self, total: int | None, quiet: bool, desc: str = "rows"):
        self.start = time.perf_counter()
        self.total = total
        self.bar = None
        if not quiet:
            # tqdm's own rate and ETA count rows; the postfix has the token-based ones
            layout = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
            self.bar = tqdm(
                total=total,
                desc=desc,
                unit="row",
                file=sys.stderr,
                dynamic_ncols=True,
                mininterval=POSTFIX_S,
                bar_format=layout if total else "{desc}: {n_fmt} [{elapsed}{postfix}]",
            )
        self.postfix = ""
        self._rate = RateWindow()
        self._rate.add(0.0, 0)
        self._last_postfix = 0.0

    def rows(self, num_rows: int) -> None:
        """Rows finished (or failed)."""
        if self.bar is not None:
            self.bar.update(num_rows)

    def tokens(self, counters: EngineCounters, summary) -> None:
        """The engines' counters after a step (`summary`: the RunSummary's row counts)."""
        now = time.perf_counter()
        if self.bar is None or now - self._last_postfix < POSTFIX_S:
            return
        self._last_postfix = now
        elapsed = now - self.start
        if counters.generated_tokens == 0 and counters.num_running == 0 and counters.kv_total == 0:
            # a prefill-only engine (embed / score / ...): input tokens are its work
            self._rate.add(elapsed, counters.num_forward_tokens)
            self.postfix = (
                f"{self._rate.rate():,.0f} input tok/s "
                f"(avg {counters.num_forward_tokens / elapsed:,.0f}), "
                f"{counters.num_waiting} waiting"
            )
            self.bar.set_postfix_str(self.postfix, refresh=False)
            return
        generated = counters.generated_tokens
        self._rate.add(elapsed, generated)
        recent = self._rate.rate()
        if counters.admitted_tokens:
            cached = counters.admitted_cached_tokens / counters.admitted_tokens
        else:
            cached = summary.cached_fraction
        s = summary
        rows_left = None if self.total is None else max(self.total - s.rows, 0)
        in_flight = generated - s.session_tokens
        eta = eta_seconds(
            rows_left, s.rows_ok, s.completion_tokens, in_flight, recent, counters.num_running
        )
        self.postfix = (
            f"{recent:,.0f} tok/s (avg {generated / elapsed:,.0f}), cached {100 * cached:.0f}%, "
            f"{counters.num_running} running, {counters.num_waiting} waiting"
            + ("" if eta is None else f", ETA {tqdm.format_interval(eta)}")
        )
        self.bar.set_postfix_str(self.postfix, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start
