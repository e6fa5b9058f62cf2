"""The data plane: Envoy processes of our own, driven by file-based xDS.

A route change is pushed make-before-break, stage by stage, and each stage waits until every
process acknowledges it (its /config_dump reports the version written): clusters (old and new
side by side, all active, none warming), then route files and listeners, then the clusters no
route references any more are dropped (push.py). Desired routes are written to disk before anything
is pushed, so a later DataPlane (after a crash of the daemon) re-derives and finishes the push.
This module keeps the processes: starts or adopts them, restarts the dead with backoff, replaces
a hung one, and re-syncs one that fell behind its files.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import aiohttp

from servekeeper.dataplane.admin import AdminClient, ProcessConfig
from servekeeper.dataplane.model import BackendStats, DataPlaneError, RouteObservation, ServiceRoute
from servekeeper.dataplane.observe import never_falling, observe_routes, sum_backend_stats
from servekeeper.dataplane.process import (
    EnvoyProcess,
    ProcessInfo,
    find_envoy_binary,
    load_records,
    save_records,
    spawn,
    terminate,
    write_atomically,
)
from servekeeper.dataplane.push import ConfigPusher
from servekeeper.dataplane.render import render_bootstrap
from servekeeper.dataplane.supervision import Backoff
from servekeeper.dataplane.xds import XdsFiles
from servekeeper.providers.ports import PortAllocator, port_is_free

logger = logging.getLogger(__name__)
T = TypeVar("T")
# A live process whose admin port has not answered for this long is hung (a starting Envoy
# answers within a second or two).
HUNG_AFTER_S = 10.0


class DataPlane:
    def __init__(
        self,
        state_dir: Path,
        processes: int = 2,
        envoy_binary: str | None = None,
        *,
        ack_timeout_s: float = 10.0,
        log_level: str = "info",
    ) -> None:
        if processes < 1:
            raise DataPlaneError("the data plane needs at least one Envoy process")
        self.dir = state_dir / "dataplane"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._binary = find_envoy_binary(envoy_binary)
        self._count = processes
        self._log_level = log_level
        self._files = {i: XdsFiles(self.dir / f"envoy-{i}") for i in range(processes)}
        self._pusher = ConfigPusher(self.dir, self._files, self._read_config, ack_timeout_s)
        self._processes: dict[int, EnvoyProcess] = {}
        self._failed_over: dict[str, tuple[str, int]] = {}  # backend -> (epoch, highest rq_failed_over)
        self._backoff = {i: Backoff() for i in range(processes)}
        self._answered_at: dict[int, float] = {}  # process index -> when its admin last answered
        self._lock = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None

    # -- public API -----------------------------------------------------------------------------

    def processes(self) -> list[ProcessInfo]:
        return [
            ProcessInfo(p.index, p.pid, p.admin_port) for p in sorted(self._processes.values(), key=lambda p: p.index)
        ]

    async def start_or_adopt(self) -> None:
        """Adopt the processes recorded in the state dir that still run, start the missing ones, and
        bring every one to the desired routes (finishing a push a crash may have cut short)."""
        async with self._lock:
            self._pusher.load_desired()
            for record in load_records(self._records_path):
                if record.index < self._count and record.alive():
                    self._processes[record.index] = record
                    logger.info("[dataplane] adopted envoy-%d (pid %d)", record.index, record.pid)
                elif record.index >= self._count and record.alive():
                    await asyncio.to_thread(terminate, [record])
            for index in range(self._count):
                if index not in self._processes:
                    self._start(index)
            await self._wait_ready(list(self._processes.values()))
            await self._pusher.push(self._pusher.routes)

    async def set_route(self, route: ServiceRoute) -> None:
        """Returns once every process has the new route; raises DataPlaneError otherwise."""
        async with self._lock:
            previous = self._pusher.routes.get(route.service)
            if previous is None or previous.port != route.port:
                self._check_port_free(route.port, route.service)
            if route.grpc_port is not None and (previous is None or previous.grpc_port != route.grpc_port):
                self._check_port_free(route.grpc_port, route.service)
            if route.preview_port is not None and (previous is None or previous.preview_port != route.preview_port):
                self._check_port_free(route.preview_port, route.service)
            await self._pusher.push({**self._pusher.routes, route.service: route})

    async def remove_route(self, service: str) -> None:
        async with self._lock:
            routes = self._pusher.routes
            if service in routes:
                await self._pusher.push({name: r for name, r in routes.items() if name != service})

    async def routes(self) -> dict[str, RouteObservation]:
        """Per service, the weights every process acknowledged and each backend's in-flight count
        summed over the processes. Raises DataPlaneError if any process cannot be read: the
        caller must then treat every backend as busy, never as idle."""
        answers = await self._read_all(lambda admin, port: asyncio.gather(admin.config(port), admin.stats(port)))
        return observe_routes(answers)

    async def backend_stats(self) -> dict[str, BackendStats]:
        """Per backend, counters summed over the processes, tagged with the processes' pids: a
        process that restarted starts its counters at 0, so sums of two epochs never compare."""
        epoch = self._epoch()
        stats = sum_backend_stats(await self._read_all(lambda admin, port: admin.stats(port)))
        if self._epoch() != epoch:
            raise DataPlaneError("an Envoy process was replaced while its stats were read")
        return never_falling(
            {name: replace(backend, epoch=epoch) for name, backend in stats.items()}, self._failed_over, epoch
        )

    def _epoch(self) -> str:
        return ",".join(str(p.pid) for p in sorted(self._processes.values(), key=lambda p: p.index))

    async def healthy(self) -> bool:
        if len(self._processes) < self._count or not all(p.alive() for p in self._processes.values()):
            return False
        admin = self._admin()
        return all(await asyncio.gather(*(admin.ready(p.admin_port) for p in self._processes.values())))

    async def supervise(self, stop: asyncio.Event, check_interval_s: float = 0.1, sync_interval_s: float = 1.0) -> None:
        """Restart dead processes (with backoff) and re-push to any process whose applied versions
        differ from its files. Never raises: a failure is logged and tried again."""
        loop = asyncio.get_running_loop()
        next_sync = loop.time() + sync_interval_s
        while not stop.is_set():
            try:
                self._revive_dead()
                if loop.time() >= next_sync:
                    next_sync = loop.time() + sync_interval_s
                    await self._resync_behind()
            except DataPlaneError as exc:
                logger.warning("[dataplane] supervision: %s", exc)
            except Exception:  # the guard of a background task: log it, keep supervising
                logger.exception("[dataplane] supervision step failed")
            try:
                await asyncio.wait_for(stop.wait(), check_interval_s)
            except (asyncio.TimeoutError, TimeoutError):
                pass

    async def stop(self) -> None:
        """Stop every Envoy process (TERM, wait, KILL): `servekeeper down`."""
        records = {p.index: p for p in load_records(self._records_path)}
        records.update(self._processes)
        await asyncio.to_thread(terminate, list(records.values()))
        self._processes.clear()
        save_records(self._records_path, [])
        await self.close()

    def forget_routes(self) -> None:
        """Drop every stored route (`servekeeper down`): the next start serves no stale route."""
        self._pusher.forget()

    def desired_route(self, service: str) -> ServiceRoute | None:
        """The route last asked for (acknowledged or not): to see whether a spec changed it."""
        return self._pusher.routes.get(service)

    async def close(self) -> None:
        """Let go of the processes without stopping them (the daemon exits, Envoy serves on)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- processes ------------------------------------------------------------------------------

    @property
    def _records_path(self) -> Path:
        return self.dir / "processes.json"

    def _admin(self) -> AdminClient:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return AdminClient(self._session)

    def _start(self, index: int) -> EnvoyProcess:
        files = self._files[index]
        if not files.initialised():
            # A new process starts straight on the desired routes: its files are complete before it reads them.
            self._pusher.write_final(index, self._pusher.routes)
        taken = [p.admin_port for p in self._processes.values()]
        taken += [port for r in self._pusher.routes.values() for port in r.listener_ports()]
        admin_port = PortAllocator(taken).one()
        write_atomically(files.bootstrap, json.dumps(render_bootstrap(f"envoy-{index}", admin_port, files.dir)))
        process = spawn(
            self._binary, index, files.bootstrap, admin_port, self.dir / f"envoy-{index}.log", self._log_level
        )
        self._processes[index] = process
        self._backoff[index].started(time.monotonic())
        self._answered_at[index] = time.monotonic()  # a grace period to come up
        save_records(self._records_path, list(self._processes.values()))
        logger.info("[dataplane] started envoy-%d (pid %d, admin port %d)", index, process.pid, admin_port)
        return process

    def _revive_dead(self) -> None:
        now = time.monotonic()
        for index in range(self._count):
            process = self._processes.get(index)
            if process is not None and process.alive():
                continue
            backoff = self._backoff[index]
            if process is not None and backoff.dead_since is None:
                code = process.popen.poll() if process.popen is not None else None
                backoff.died(now)
                logger.warning("[dataplane] envoy-%d (pid %d) exited (code %s)", index, process.pid, code)
            if backoff.may_restart(now):
                try:
                    self._start(index)
                except (OSError, DataPlaneError) as exc:  # the binary gone, no port: paced like a crash
                    backoff.started(now)
                    backoff.died(now)
                    logger.error("[dataplane] envoy-%d could not be started: %s", index, exc)

    async def _wait_ready(self, processes: list[EnvoyProcess], timeout: float = 15.0) -> None:
        admin = self._admin()
        deadline = time.monotonic() + timeout
        pending = list(processes)
        while pending and time.monotonic() < deadline:
            answers = await asyncio.gather(*(admin.ready(p.admin_port) for p in pending))
            for process in [p for p, ok in zip(pending, answers, strict=True) if not ok]:
                if not process.alive():
                    raise DataPlaneError(f"envoy-{process.index} exited at start; see {self.dir}/envoy-*.log")
            pending = [p for p, ok in zip(pending, answers, strict=True) if not ok]
            if pending:
                await asyncio.sleep(0.05)
        if pending:
            raise DataPlaneError(f"Envoy processes {[p.index for p in pending]} not ready within {timeout:g}s")

    async def _read_all(self, read: Callable[[AdminClient, int], Awaitable[T]]) -> list[T]:
        if len(self._processes) < self._count:
            raise DataPlaneError(f"only {len(self._processes)} of {self._count} Envoy processes are running")
        admin = self._admin()
        return list(await asyncio.gather(*(read(admin, p.admin_port) for p in self._processes.values())))

    async def _read_config(self, index: int) -> ProcessConfig:
        process = self._processes.get(index)
        if process is None:
            raise DataPlaneError("not running")
        return await self._admin().config(process.admin_port)

    def _check_port_free(self, port: int, service: str) -> None:
        if any(port in r.listener_ports() for r in self._pusher.routes.values()) or not port_is_free(port):
            raise DataPlaneError(f"service {service}: port {port} is already in use")

    # -- keeping processes in step -------------------------------------------------------------

    async def _resync_behind(self) -> None:
        """A process whose applied versions differ from its files (it rejected or missed a reload)
        gets the desired routes again."""
        async with self._lock:
            admin = self._admin()
            for i, process in sorted(self._processes.items()):
                if not process.alive():
                    continue
                try:
                    config = await admin.config(process.admin_port)
                except DataPlaneError:
                    # Starting, or about to be restarted; but one alive and silent this long is
                    # hung: it cannot be re-synced or drained, so it is replaced.
                    silent_since = self._answered_at.setdefault(i, time.monotonic())
                    if time.monotonic() - silent_since >= HUNG_AFTER_S:
                        logger.error("[dataplane] envoy-%d (pid %d) does not answer; replacing it", i, process.pid)
                        self._answered_at.pop(i, None)
                        await asyncio.to_thread(terminate, [process], 2.0)
                    continue
                self._answered_at[i] = time.monotonic()
                if not self._pusher.in_step(i, config):
                    logger.warning("[dataplane] envoy-%d is behind its files; writing the desired routes again", i)
                    self._pusher.write_final(i, self._pusher.routes, config)
