"""When the engine process tells the main process about finished completions.

Waking the main process has a price on both sides (a frame to encode and send, a thread to wake,
a message to decode and dispatch), and it is paid per wake-up, not per completion. So finished
completions are held until `notify_batch` of them are ready and then sent as one message. Holding
them never loses or starves any: they go out at once when the engine has nothing left to run (the
final flush), when the main process asks for a stop, and at the latest `max_delay` seconds after
the oldest one finished (so a slow model still reports progress and commits on time).

At most one message per engine step: the check runs once after each step.
"""

from __future__ import annotations

import time

from batchrun.params import GenerateResult

DEFAULT_NOTIFY_BATCH = 16
DEFAULT_MAX_DELAY = 0.5  # seconds


class NotifyBatcher:
    def __init__(
        self, notify_batch: int = DEFAULT_NOTIFY_BATCH, max_delay: float = DEFAULT_MAX_DELAY
    ):
        if notify_batch < 1:
            raise ValueError(f"notify_batch must be >= 1; got {notify_batch}")
        self.notify_batch = notify_batch
        self.max_delay = max_delay
        self._held: list[GenerateResult] = []
        self._oldest = 0.0  # monotonic time the oldest held completion finished

    def add(self, results: list[GenerateResult]) -> None:
        if results and not self._held:
            self._oldest = time.monotonic()
        self._held.extend(results)

    def due(self, idle: bool) -> bool:
        """Send now? `idle`: the engine has nothing left to run (flush everything)."""
        held = len(self._held)
        if held >= self.notify_batch:
            return True
        return held > 0 and (idle or time.monotonic() - self._oldest >= self.max_delay)

    def take(self) -> list[GenerateResult]:
        held, self._held = self._held, []
        return held

    def __len__(self) -> int:
        return len(self._held)
