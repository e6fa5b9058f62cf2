"""One Envoy process's xDS files. Each process has a directory of its own, so the files say exactly
what that process was given, and a process that fell behind can be re-synced on its own."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from servekeeper.dataplane.model import DataPlaneError
from servekeeper.dataplane.names import Resource, route_file
from servekeeper.dataplane.process import write_atomically
from servekeeper.dataplane.render import discovery_response


class XdsFiles:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.cds = directory / "cds.json"
        self.lds = directory / "lds.json"
        self.bootstrap = directory / "bootstrap.json"
        (directory / "rds").mkdir(parents=True, exist_ok=True)

    def route_path(self, route_config_name: str) -> Path:
        protocol, _, service = route_config_name.partition("-")
        return route_file(self.dir, protocol, service)

    def route_names(self) -> list[str]:
        return sorted(path.stem for path in (self.dir / "rds").glob("*.json"))

    def initialised(self) -> bool:
        return self.cds.exists() and self.lds.exists()

    @staticmethod
    def read(path: Path) -> tuple[str | None, dict[str, Resource]]:
        """(version, resources by name) of a file; (None, {}) when there is none."""
        try:
            data = json.loads(path.read_text())
            return data["version_info"], {r["name"]: r for r in data["resources"]}
        except FileNotFoundError:
            return None, {}
        except (ValueError, KeyError, TypeError) as exc:
            raise DataPlaneError(f"unreadable xDS file {path}: {exc!r}") from exc

    @staticmethod
    def write(path: Path, version: str, resources: Mapping[str, Resource], force: bool = False) -> str:
        """Replace the file (Envoy reloads on the rename) unless it already holds these resources;
        returns the version Envoy must report for it."""
        current_version, current = XdsFiles.read(path)
        if not force and current_version is not None and current == dict(resources):
            return current_version
        write_atomically(path, json.dumps(discovery_response(version, resources.values()), indent=1))
        return version

    def max_version(self) -> int:
        versions: list[Any] = [self.read(self.cds)[0], self.read(self.lds)[0]]
        versions += [self.read(self.route_path(name))[0] for name in self.route_names()]
        return max((int(v) for v in versions if v is not None and str(v).isdigit()), default=0)
