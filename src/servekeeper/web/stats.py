"""A short in-memory history of the ingress's per-cluster counters, for the dashboard's charts.

The daemon samples `DataPlane.backend_stats()` every `SAMPLE_SECONDS` into a ring buffer of
`HISTORY_SECONDS`; `series()` turns consecutive samples into request rate, error rate and p99
per cluster (pure). Counters restart at 0 when an Envoy process restarts: a negative difference
counts as nothing, never as a negative rate.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from servekeeper.dataplane import BackendStats, DataPlaneError

logger = logging.getLogger(__name__)

SAMPLE_SECONDS = 2.0
HISTORY_SECONDS = 600.0

Point = tuple[float, float | None]  # (wall time, value); None: nothing to measure in that interval


@dataclass(frozen=True)
class Sample:
    time: float
    stats: Mapping[str, BackendStats]


@dataclass(frozen=True)
class ClusterSeries:
    rate: list[Point] = field(default_factory=list)  # requests/s
    errors: list[Point] = field(default_factory=list)  # 5xx answers/s
    p99_ms: list[Point] = field(default_factory=list)


class StatsHistory:
    def __init__(self, sample_seconds: float = SAMPLE_SECONDS, history_seconds: float = HISTORY_SECONDS) -> None:
        self.sample_seconds = sample_seconds
        self._samples: collections.deque[Sample] = collections.deque(maxlen=int(history_seconds / sample_seconds) + 1)

    def add(self, now: float, stats: Mapping[str, BackendStats]) -> None:
        self._samples.append(Sample(now, dict(stats)))

    def samples(self) -> list[Sample]:
        return list(self._samples)

    async def run(
        self,
        read: Callable[[], Awaitable[Mapping[str, BackendStats]]],
        stop: asyncio.Event,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Sample until `stop` is set. A data plane that cannot be read leaves a gap, nothing else."""
        while not stop.is_set():
            try:
                self.add(clock(), await read())
            except DataPlaneError as exc:
                logger.debug("stats sample skipped: %s", exc)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.sample_seconds)


def _quantile_ms(before: Mapping[float, int], after: Mapping[float, int], quantile: float) -> float | None:
    bounds = sorted(after)
    deltas = [max(0, after[b] - before.get(b, 0)) for b in bounds]
    if not deltas or deltas[-1] == 0:
        return None
    wanted = quantile * deltas[-1]
    for bound, cumulative in zip(bounds, deltas, strict=True):
        if cumulative >= wanted:
            return bound
    return bounds[-1]


def series(samples: Sequence[Sample], backends: Sequence[str] | None = None) -> dict[str, ClusterSeries]:
    """Per backend, one point per pair of consecutive samples (at the later one's time)."""
    names = sorted({name for sample in samples for name in sample.stats} if backends is None else set(backends))
    result = {name: ClusterSeries() for name in names}
    for before, after in zip(samples, samples[1:], strict=False):
        elapsed = after.time - before.time
        if elapsed <= 0:
            continue
        for name in names:
            old, new = before.stats.get(name), after.stats.get(name)
            if new is None:
                continue
            old = old or BackendStats(backend=name)
            # The requests the cluster took, and those it refused that a standby answered.
            requests = max(0, new.rq_total + new.rq_failed_over - old.rq_total - old.rq_failed_over)
            result[name].rate.append((after.time, requests / elapsed))
            failed = new.rq_5xx + new.rq_failed_over - old.rq_5xx - old.rq_failed_over  # refused ones too
            result[name].errors.append((after.time, max(0, failed) / elapsed))
            result[name].p99_ms.append((after.time, _quantile_ms(old.latency_ms_buckets, new.latency_ms_buckets, 0.99)))
    return result


def service_backends(samples: Sequence[Sample], service: str, known: Sequence[str] = ()) -> list[str]:
    """The backends of one service: its clusters are named `<service>-g<generation>-<suffix>`."""
    pattern = re.compile(rf"^{re.escape(service)}-g\d+-[0-9a-f]+$")
    seen = {name for sample in samples for name in sample.stats if pattern.match(name)}
    return sorted(seen | set(known))
