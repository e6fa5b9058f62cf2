"""The data plane: Envoy processes of our own, driven by file-based xDS.

A route change is pushed make-before-break, stage by stage, and each stage waits until every
process acknowledges it (its /config_dump reports the version written): clusters (old and new
side by side, all active, none warming), then route files and listeners, then the clusters no
route references any more are dropped. Desired routes are written to disk before anything is
pushed, so a later DataPlane (after a crash of the daemon) re-derives and finishes the push.
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
from servekeeper.dataplane.model import (
    BackendStats,
    DataPlaneError,
    RouteObservation,
    ServiceRoute,
    route_from_json,
    route_to_json,
)
from servekeeper.dataplane.observe import observe_routes, sum_backend_stats, version_acknowledged
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
from servekeeper.dataplane.render import (
    listener_name,
    render_bootstrap,
    render_clusters,
    render_listeners,
    render_route_configs,
    union_clusters,
)
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
        self._ack_timeout_s = ack_timeout_s
        self._log_level = log_level
        self._files = {i: XdsFiles(self.dir / f"envoy-{i}") for i in range(processes)}
        self._processes: dict[int, EnvoyProcess] = {}
        self._backoff = {i: Backoff() for i in range(processes)}
        self._answered_at: dict[int, float] = {}  # process index -> when its admin last answered
        self._routes: dict[str, ServiceRoute] = {}
        self._version = 0
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
            self._load_desired()
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
            await self._push(self._routes)

    async def set_route(self, route: ServiceRoute) -> None:
        """Returns once every process has the new route; raises DataPlaneError otherwise."""
        async with self._lock:
            previous = self._routes.get(route.service)
            if previous is None or previous.port != route.port:
                self._check_port_free(route.port, route.service)
            if route.grpc_port is not None and (previous is None or previous.grpc_port != route.grpc_port):
                self._check_port_free(route.grpc_port, route.service)
            if route.preview_port is not None and (previous is None or previous.preview_port != route.preview_port):
                self._check_port_free(route.preview_port, route.service)
            await self._push({**self._routes, route.service: route})

    async def remove_route(self, service: str) -> None:
        async with self._lock:
            if service in self._routes:
                await self._push({name: r for name, r in self._routes.items() if name != service})

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
        return {name: replace(backend, epoch=epoch) for name, backend in stats.items()}

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
        self._routes = {}
        (self.dir / "desired.json").unlink(missing_ok=True)

    def desired_route(self, service: str) -> ServiceRoute | None:
        """The route last asked for (acknowledged or not): to see whether a spec changed it."""
        return self._routes.get(service)

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
            self._write_final(index, self._routes)
        taken = [p.admin_port for p in self._processes.values()]
        taken += [port for r in self._routes.values() for port in r.listener_ports()]
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

    def _check_port_free(self, port: int, service: str) -> None:
        if any(port in r.listener_ports() for r in self._routes.values()) or not port_is_free(port):
            raise DataPlaneError(f"service {service}: port {port} is already in use")

    # -- pushing --------------------------------------------------------------------------------

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    def _load_desired(self) -> None:
        try:
            data = json.loads((self.dir / "desired.json").read_text())
        except FileNotFoundError:
            data = {"version": 0, "routes": []}
        except ValueError as exc:
            raise DataPlaneError(f"unreadable {self.dir / 'desired.json'}: {exc!r}") from exc
        self._routes = {route.service: route for route in map(route_from_json, data["routes"])}
        # Versions never repeat, even if the record of the last one was lost with a crash.
        self._version = max([int(data["version"])] + [files.max_version() for files in self._files.values()])

    def _save_desired(self, routes: dict[str, ServiceRoute]) -> None:
        payload = {"version": self._version, "routes": [route_to_json(r) for r in routes.values()]}
        write_atomically(self.dir / "desired.json", json.dumps(payload, indent=1))

    def _write_final(self, index: int, routes: dict[str, ServiceRoute], applied: ProcessConfig | None = None) -> None:
        """The desired routes straight into a process's files, for a process that has not started
        yet or whose state is unknown. With `applied`, each file keeps the version the process
        reports: Envoy leaves its version alone on an update that changes nothing, so a fresh
        version would make a process that already has the right config look behind forever,
        while the reported one converges either way (applied, or already there)."""
        files = self._files[index]
        applied = applied or ProcessConfig()
        for name, config in render_route_configs(routes.values()).items():
            version = applied.route_versions.get(name) or self._next_version()
            XdsFiles.write(files.route_path(name), version, {name: config}, force=True)
        clusters = render_clusters(routes.values())
        XdsFiles.write(files.cds, applied.cds_version or self._next_version(), clusters, force=True)
        listeners = render_listeners(routes.values(), files.dir)
        XdsFiles.write(files.lds, applied.lds_version or self._next_version(), listeners, force=True)

    async def _push(self, routes: dict[str, ServiceRoute]) -> None:
        """Make before break, each stage acknowledged by every process before the next one."""
        targets = sorted(self._files)
        self._save_desired(routes)  # intent first: a crash from here on is finished by the next DataPlane
        self._routes = dict(routes)
        final_clusters = render_clusters(routes.values())
        route_configs = render_route_configs(routes.values())

        # 1. Clusters: the new ones beside the ones the current routes use; all active, none warming.
        expected: dict[int, tuple[str, set[str]]] = {}
        for i in targets:
            current = XdsFiles.read(self._files[i].cds)[1]
            union = union_clusters(current, final_clusters)
            expected[i] = (XdsFiles.write(self._files[i].cds, self._next_version(), union), set(union))
        await self._wait(
            targets,
            "clusters",
            lambda i, c: (
                version_acknowledged(c.cds_version, expected[i][0], expected[i][1])
                and expected[i][1] <= c.active_clusters
                and not (expected[i][1] & c.warming_clusters)
            ),
        )

        # 2. Route files (weights move here), then listeners (a new service's listener reads its
        #    route file as it warms; an unchanged listener is left alone, connections and all).
        route_versions: dict[int, dict[str, str]] = {}
        lds_versions: dict[int, str] = {}
        for i in targets:
            files = self._files[i]
            route_versions[i] = {
                name: XdsFiles.write(files.route_path(name), self._next_version(), {name: config})
                for name, config in route_configs.items()
            }
            lds_versions[i] = XdsFiles.write(
                files.lds, self._next_version(), render_listeners(routes.values(), files.dir)
            )
        listeners = {listener_name(*name.split("-", 1)) for name in route_configs}
        await self._wait(
            targets,
            "routes and listeners",
            lambda i, c: (
                version_acknowledged(c.lds_version, lds_versions[i], listeners)
                and listeners == c.active_listeners
                and all(c.route_versions.get(name) == version for name, version in route_versions[i].items())
            ),
        )

        # 3. Break: drop the clusters no route references any more.
        final_versions = {i: XdsFiles.write(self._files[i].cds, self._next_version(), final_clusters) for i in targets}
        await self._wait(
            targets,
            "cluster removal",
            lambda i, c: (
                version_acknowledged(c.cds_version, final_versions[i], final_clusters)
                and c.active_clusters == set(final_clusters)
            ),
        )
        for i in targets:
            for name in set(self._files[i].route_names()) - set(route_configs):
                self._files[i].route_path(name).unlink(missing_ok=True)
        self._save_desired(routes)

    async def _wait(self, targets: list[int], stage: str, acknowledged: Callable[[int, ProcessConfig], bool]) -> None:
        admin = self._admin()
        deadline = time.monotonic() + self._ack_timeout_s
        pending = set(targets)
        last: dict[int, str] = {}
        while True:
            for i in sorted(pending):
                process = self._processes.get(i)
                if process is None:
                    last[i] = "not running"
                    continue
                try:
                    config = await admin.config(process.admin_port)
                except DataPlaneError as exc:
                    last[i] = str(exc)
                    continue
                if acknowledged(i, config):
                    pending.discard(i)
                else:
                    last[i] = f"applied {config}"
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise DataPlaneError(
                    f"{stage}: Envoy processes {sorted(pending)} did not acknowledge within {self._ack_timeout_s:g}s "
                    f"(see {self.dir}/envoy-N.log); last seen: {[last.get(i) for i in sorted(pending)]}"
                )
            await asyncio.sleep(0.02)

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
                if not self._in_step(i, config):
                    logger.warning("[dataplane] envoy-%d is behind its files; writing the desired routes again", i)
                    self._write_final(i, self._routes, config)

    def _in_step(self, index: int, config: ProcessConfig) -> bool:
        files = self._files[index]
        cds_version, clusters = XdsFiles.read(files.cds)
        lds_version, listeners = XdsFiles.read(files.lds)
        if not version_acknowledged(config.cds_version, cds_version, clusters) or config.active_clusters != set(
            clusters
        ):
            return False
        if not version_acknowledged(config.lds_version, lds_version, listeners) or config.active_listeners != set(
            listeners
        ):
            return False
        return all(config.route_versions.get(n) == XdsFiles.read(files.route_path(n))[0] for n in files.route_names())
