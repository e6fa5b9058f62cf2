"""Restart pacing for a crashed process: at once after a crash of a process that had been up a
while, then 0.5 s, 1 s, 2 s ... up to 30 s while it keeps dying young. Never a tight loop."""

from __future__ import annotations

from dataclasses import dataclass

YOUNG_S = 5.0  # a process that dies younger than this counts as crash-looping
FIRST_DELAY_S = 0.5
MAX_DELAY_S = 30.0


@dataclass
class Backoff:
    started_at: float | None = None
    dead_since: float | None = None
    young_deaths: int = 0

    def started(self, now: float) -> None:
        self.started_at = now
        self.dead_since = None

    def died(self, now: float) -> None:
        self.dead_since = now
        if self.started_at is not None and now - self.started_at < YOUNG_S:
            self.young_deaths += 1
        else:
            self.young_deaths = 0

    def delay(self) -> float:
        if self.young_deaths <= 1:
            return 0.0
        return float(min(FIRST_DELAY_S * 2.0 ** (self.young_deaths - 2), MAX_DELAY_S))

    def may_restart(self, now: float) -> bool:
        if self.dead_since is None:  # never started, or not seen dying: start now
            return True
        return now - self.dead_since >= self.delay()
