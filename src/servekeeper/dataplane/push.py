"""Pushing the desired routes to the Envoy processes through their xDS files, and waiting for
every process to acknowledge each stage (its /config_dump reports the version written).

The desired routes are kept in desired.json, written before anything is pushed, so that a later
pusher (after a crash of the daemon) re-derives the push and finishes it. Versions never repeat.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from servekeeper.dataplane.admin import ProcessConfig
from servekeeper.dataplane.clusters import render_clusters, union_clusters
from servekeeper.dataplane.model import DataPlaneError, ServiceRoute, route_from_json, route_to_json
from servekeeper.dataplane.names import Resource, listener_name
from servekeeper.dataplane.observe import version_acknowledged
from servekeeper.dataplane.process import write_atomically
from servekeeper.dataplane.render import render_listeners, render_route_configs
from servekeeper.dataplane.xds import XdsFiles

# Reads what the process with this index has applied; raises DataPlaneError when it cannot.
ConfigReader = Callable[[int], Awaitable[ProcessConfig]]


class ConfigPusher:
    def __init__(self, directory: Path, files: dict[int, XdsFiles], read_config: ConfigReader, ack_timeout_s: float):
        self.dir = directory
        self.files = files
        self.routes: dict[str, ServiceRoute] = {}  # the desired routes, acknowledged or not
        self._read_config = read_config
        self._ack_timeout_s = ack_timeout_s
        self._version = 0

    @property
    def _desired_path(self) -> Path:
        return self.dir / "desired.json"

    def load_desired(self) -> None:
        try:
            data = json.loads(self._desired_path.read_text())
        except FileNotFoundError:
            data = {"version": 0, "routes": []}
        except ValueError as exc:
            raise DataPlaneError(f"unreadable {self._desired_path}: {exc!r}") from exc
        self.routes = {route.service: route for route in map(route_from_json, data["routes"])}
        # Versions never repeat, even if the record of the last one was lost with a crash.
        self._version = max([int(data["version"])] + [files.max_version() for files in self.files.values()])

    def forget(self) -> None:
        """Drop every stored route: the next start serves no stale route."""
        self.routes = {}
        self._desired_path.unlink(missing_ok=True)

    def _save_desired(self, routes: dict[str, ServiceRoute]) -> None:
        payload = {"version": self._version, "routes": [route_to_json(r) for r in routes.values()]}
        write_atomically(self._desired_path, json.dumps(payload, indent=1))

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    def write_final(self, index: int, routes: dict[str, ServiceRoute], applied: ProcessConfig | None = None) -> None:
        """The desired routes straight into a process's files, for a process that has not started
        yet or whose state is unknown. With `applied`, each file keeps the version the process
        reports: Envoy leaves its version alone on an update that changes nothing, so a fresh
        version would make a process that already has the right config look behind forever,
        while the reported one converges either way (applied, or already there)."""
        files = self.files[index]
        applied = applied or ProcessConfig()
        for name, config in render_route_configs(routes.values()).items():
            version = applied.route_versions.get(name) or self._next_version()
            XdsFiles.write(files.route_path(name), version, {name: config}, force=True)
        clusters = render_clusters(routes.values())
        XdsFiles.write(files.cds, applied.cds_version or self._next_version(), clusters, force=True)
        listeners = render_listeners(routes.values(), files.dir)
        XdsFiles.write(files.lds, applied.lds_version or self._next_version(), listeners, force=True)

    def in_step(self, index: int, config: ProcessConfig) -> bool:
        """Has the process applied exactly what its files hold?"""
        files = self.files[index]
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

    # -- make before break ----------------------------------------------------------------------

    async def push(self, routes: dict[str, ServiceRoute]) -> None:
        """Make before break, each stage acknowledged by every process before the next one."""
        targets = sorted(self.files)
        self._save_desired(routes)  # intent first: a crash from here on is finished by the next DataPlane
        self.routes = dict(routes)
        final_clusters = render_clusters(routes.values())
        route_configs = render_route_configs(routes.values())
        await self._add_clusters(targets, final_clusters)
        await self._switch_routes(targets, routes, route_configs)
        await self._drop_clusters(targets, final_clusters)
        for i in targets:
            for name in set(self.files[i].route_names()) - set(route_configs):
                self.files[i].route_path(name).unlink(missing_ok=True)
        self._save_desired(routes)

    async def _add_clusters(self, targets: list[int], final_clusters: dict[str, Resource]) -> None:
        """1. Clusters: the new ones beside the ones the current routes use; all active, none warming."""
        expected: dict[int, tuple[str, set[str]]] = {}
        for i in targets:
            current = XdsFiles.read(self.files[i].cds)[1]
            union = union_clusters(current, final_clusters)
            expected[i] = (XdsFiles.write(self.files[i].cds, self._next_version(), union), set(union))
        await self._wait(
            targets,
            "clusters",
            lambda i, c: (
                version_acknowledged(c.cds_version, expected[i][0], expected[i][1])
                and expected[i][1] <= c.active_clusters
                and not (expected[i][1] & c.warming_clusters)
            ),
        )

    async def _switch_routes(
        self, targets: list[int], routes: dict[str, ServiceRoute], route_configs: dict[str, Resource]
    ) -> None:
        """2. Route files (weights move here), then listeners (a new service's listener reads its
        route file as it warms; an unchanged listener is left alone, connections and all)."""
        route_versions: dict[int, dict[str, str]] = {}
        lds_versions: dict[int, str] = {}
        for i in targets:
            files = self.files[i]
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

    async def _drop_clusters(self, targets: list[int], final_clusters: dict[str, Resource]) -> None:
        """3. Break: drop the clusters no route references any more."""
        final_versions = {i: XdsFiles.write(self.files[i].cds, self._next_version(), final_clusters) for i in targets}
        await self._wait(
            targets,
            "cluster removal",
            lambda i, c: (
                version_acknowledged(c.cds_version, final_versions[i], final_clusters)
                and c.active_clusters == set(final_clusters)
            ),
        )

    async def _wait(self, targets: list[int], stage: str, acknowledged: Callable[[int, ProcessConfig], bool]) -> None:
        deadline = time.monotonic() + self._ack_timeout_s
        pending = set(targets)
        last: dict[int, str] = {}
        while True:
            for i in sorted(pending):
                try:
                    config = await self._read_config(i)
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
