"""A closed-loop HTTP load: fixed concurrency, keep-alive, for a fixed time. Latencies in ms."""

from __future__ import annotations

import asyncio
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp


@dataclass
class LoopResult:
    label: str
    requests: int
    failures: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def closed_loop(label: str, url: str, clients: int, seconds: float, warmup: float = 1.0) -> LoopResult:
    latencies: list[float] = []
    failures = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as session:
        start = time.perf_counter()
        measure_from = start + warmup
        end = measure_from + seconds

        async def client() -> None:
            nonlocal failures
            while True:
                sent = time.perf_counter()
                if sent >= end:
                    return
                try:
                    async with session.get(url) as response:
                        await response.read()
                        ok = response.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                done = time.perf_counter()
                if sent >= measure_from:
                    if ok:
                        latencies.append((done - sent) * 1000)
                    else:
                        failures += 1

        await asyncio.gather(*(client() for _ in range(clients)))
    return LoopResult(
        label=label,
        requests=len(latencies),
        failures=failures,
        seconds=seconds,
        rps=len(latencies) / seconds,
        p50_ms=statistics.median(latencies) if latencies else float("nan"),
        p99_ms=percentile(latencies, 0.99),
    )


def exit_cleanly_on_sigterm() -> None:
    """A benchmark stopped by `timeout` or CI must still stop the clusters it started."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
