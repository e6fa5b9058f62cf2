"""Runs the readiness probes a spec declares against each cluster's own Serve endpoint.

Each probe of each cluster runs in a background task of its own, every `periodSeconds`, so a
slow or hanging probe never holds up a reconcile tick or another probe; a tick only reads the
latest results. Results are keyed by the probe's identity (its whole definition), not its
position in the list: editing one probe restarts only that probe's count.

Results live in memory: after a controller restart they start again from zero, which can only
delay a switch, never allow an early one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from servekeeper.core.health import probe_result
from servekeeper.model.observation import ProbeState
from servekeeper.model.spec import ProbeSpec

logger = logging.getLogger(__name__)


@dataclass
class _Track:
    probe: ProbeSpec
    consecutive: int = 0
    last_ok: bool | None = None
    last_message: str = ""
    last_time: float | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    def state(self) -> ProbeState:
        return ProbeState(
            path=self.probe.path,
            passing=self.consecutive >= self.probe.successThreshold,
            consecutive_successes=self.consecutive,
            success_threshold=self.probe.successThreshold,
            last_ok=self.last_ok,
            last_message=self.last_message,
            last_time=self.last_time,
        )


class ProbeRunner:
    def __init__(self, session: aiohttp.ClientSession, clock: Callable[[], float] = time.time) -> None:
        self._session = session
        self._clock = clock
        self._tracks: dict[tuple[str, ProbeSpec], _Track] = {}

    def states(self, cluster: str, serve_url: str, probes: list[ProbeSpec]) -> tuple[ProbeState, ...]:
        """The latest results; starts the probes not running yet and stops those no longer declared."""
        wanted = {(cluster, probe) for probe in probes}
        for key in [key for key in self._tracks if key[0] == cluster and key not in wanted]:
            self._stop(key)
        states = []
        for probe in probes:
            track = self._tracks.get((cluster, probe))
            if track is None:
                track = self._tracks[(cluster, probe)] = _Track(probe)
                track.task = asyncio.create_task(self._loop(track, serve_url), name=f"probe-{cluster}-{probe.path}")
            states.append(track.state())
        return tuple(states)

    async def _loop(self, track: _Track, serve_url: str) -> None:
        while True:
            try:
                await self._probe(track, serve_url)
            except asyncio.CancelledError:
                raise
            except Exception:  # a probe must never die silently: log it and keep probing
                logger.exception("probe %s failed unexpectedly", track.probe.path)
            await asyncio.sleep(track.probe.periodSeconds)

    async def _probe(self, track: _Track, serve_url: str) -> None:
        probe = track.probe
        timeout = aiohttp.ClientTimeout(total=probe.timeoutSeconds)
        try:
            async with self._session.get(serve_url + probe.path, timeout=timeout, allow_redirects=False) as response:
                body = (await response.content.read(64 * 1024)).decode(errors="replace")
                ok, message = probe_result(response.status, body, probe.expectStatus, probe.bodyContains)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            ok, message = False, f"{type(exc).__name__}: {exc}"[:300]
        track.consecutive = track.consecutive + 1 if ok else 0
        track.last_ok = ok
        track.last_message = message
        track.last_time = self._clock()

    def _stop(self, key: tuple[str, ProbeSpec]) -> None:
        track = self._tracks.pop(key)
        if track.task is not None:
            track.task.cancel()

    def forget(self, cluster: str) -> None:
        for key in [key for key in self._tracks if key[0] == cluster]:
            self._stop(key)

    async def close(self) -> None:
        tasks = [track.task for track in self._tracks.values() if track.task is not None]
        for key in list(self._tracks):
            self._stop(key)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
