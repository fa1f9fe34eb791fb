"""Token rates and the ETA, as the progress bar and the progress server report them.

The live rate is a sliding window: the tokens counted over the last WINDOW_S seconds, divided by
the time they span. Counts arrive in bursts (the engine process reports at most every 0.5 s, or
when a batch of rows finishes; an in-process step on a CPU can take seconds), and a window long
next to those bursts keeps their jitter small (0.5 s in 20 s: about 2 %) while a change of pace
shows within 20 s, short next to a batch run's phases. A window, rather than an exponentially
weighted average, because its value is a plain fact a person can check against the counters
("tokens in the last 20 s / 20 s"), it forgets a start-up burst completely, and a stall reads
0 tok/s exactly one window after the last token. Until a run is WINDOW_S old the window spans
the whole run, so the live rate starts out as the run's average.
"""

from __future__ import annotations

from collections import deque

WINDOW_S = 20.0


class RateWindow:
    """The rate of a cumulative count over the last `window_s` seconds; `add` samples it."""

    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()  # (seconds, count), oldest first

    @property
    def has_samples(self) -> bool:
        return bool(self._samples)

    def add(self, t: float, count: float) -> None:
        """The count at `t` seconds (a clock that restarts, going back, starts over)."""
        samples = self._samples
        if samples and t < samples[-1][0]:
            samples.clear()
        elif samples and t == samples[-1][0]:
            samples[-1] = (t, count)  # same instant: the newer count
            return
        samples.append((t, count))
        # keep one sample at or before the window's start, so the rate spans the full window
        start = t - self.window_s
        while len(samples) > 2 and samples[1][0] <= start:
            samples.popleft()

    def rate(self) -> float:
        """Count per second over the window (0 before two samples)."""
        if len(self._samples) < 2:
            return 0.0
        (t0, c0), (t1, c1) = self._samples[0], self._samples[-1]
        return max(c1 - c0, 0.0) / (t1 - t0)


def eta_seconds(
    rows_left: int | None,
    rows_ok: int,
    completion_tokens: int,
    tokens_in_flight: int,
    tok_s: float,
    num_running: int = 0,
) -> float | None:
    """Seconds until the rows left are done: the longer of two estimates, the tokens they still
    need at `tok_s` and the decode steps they still need at the step time seen now.

    Tokens: `rows_left` x the average output tokens of a row, less the `tokens_in_flight`
    already generated for the `num_running` rows not finished yet. Steps: a running row gains
    one token a step, so a step takes `num_running / tok_s` seconds; the run needs at least its
    tokens spread over the running rows, and at least the running rows' remaining length (plus
    a whole row's for rows not started yet) one step after another.

    NOTE: the rows that finish first are the short ones (the first to stop are those that met
    their end of text early), so the finished rows' average alone reads far too low early in a
    run of mixed lengths, and the run's tail (a few long rows, a step each token) is not token
    bound at all. A running row that has generated g tokens is counted as needing about g more
    (the estimate for a length known only to exceed g), in the average and in its remaining
    length. None while unknown: no total, no row finished, no rate."""
    if rows_left is None or rows_ok <= 0 or tok_s <= 0:
        return None
    if rows_left == 0:
        return 0.0
    finished_avg = completion_tokens / rows_ok
    tokens = rows_left * finished_avg - tokens_in_flight
    by_tokens = tokens / tok_s if tokens > 0 else None
    if num_running <= 0:
        return by_tokens
    avg = max(finished_avg, (completion_tokens + 2 * tokens_in_flight) / (rows_ok + num_running))
    not_started = max(rows_left - num_running, 0)
    needed = not_started * avg + tokens_in_flight
    path = tokens_in_flight / num_running + (avg if not_started else 0.0)
    by_steps = max(needed / num_running, path) * num_running / tok_s
    return max(by_steps, by_tokens or 0.0)
