"""Runs the readiness probes a spec declares against each cluster's own Serve endpoint.

Results live in memory: after a controller restart they start again from zero, which can only
delay a switch, never allow an early one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from servekeeper.core.health import probe_result
from servekeeper.spec import ProbeSpec
from servekeeper.status import ProbeState


@dataclass
class _Track:
    consecutive: int = 0
    last_ok: bool | None = None
    last_message: str = ""
    last_time: float | None = None
    last_run_monotonic: float = float("-inf")


class ProbeRunner:
    def __init__(self, session: aiohttp.ClientSession, clock: Callable[[], float] = time.time) -> None:
        self._session = session
        self._clock = clock
        self._tracks: dict[tuple[str, int], _Track] = {}

    async def run(self, cluster: str, serve_url: str, probes: list[ProbeSpec]) -> tuple[ProbeState, ...]:
        states = []
        for index, probe in enumerate(probes):
            track = self._tracks.setdefault((cluster, index), _Track())
            if time.monotonic() - track.last_run_monotonic >= probe.periodSeconds:
                await self._probe(track, serve_url, probe)
            states.append(
                ProbeState(
                    path=probe.path,
                    passing=track.consecutive >= probe.successThreshold,
                    consecutive_successes=track.consecutive,
                    success_threshold=probe.successThreshold,
                    last_ok=track.last_ok,
                    last_message=track.last_message,
                    last_time=track.last_time,
                )
            )
        return tuple(states)

    async def _probe(self, track: _Track, serve_url: str, probe: ProbeSpec) -> None:
        track.last_run_monotonic = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=probe.timeoutSeconds)
        try:
            async with self._session.get(serve_url + probe.path, timeout=timeout, allow_redirects=False) as response:
                body = (await response.content.read(64 * 1024)).decode(errors="replace")
                ok, message = probe_result(response.status, body, probe.expectStatus, probe.bodyContains)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            ok, message = False, f"{type(exc).__name__}: {exc}"[:300]
        track.consecutive = track.consecutive + 1 if ok else 0
        track.last_ok = ok
        track.last_message = message
        track.last_time = self._clock()

    def forget(self, cluster: str) -> None:
        for key in [key for key in self._tracks if key[0] == cluster]:
            del self._tracks[key]
