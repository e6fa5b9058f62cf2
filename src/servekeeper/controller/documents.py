"""What the controller keeps of what it sent: the Serve configs PUT to each cluster (stored, cached
here) and the code packages in the state dir. Observe reads them; submit writes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from servekeeper.model.records import ServiceRecord
from servekeeper.rayapi.package import Package
from servekeeper.store.store import Store


class SubmittedDocuments:
    """The Serve configs sent to each cluster, by config hash: kept in the store, cached here."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.cache: dict[tuple[str, str], dict[str, Any]] = {}  # (cluster, config hash) -> what was PUT

    def get(self, cluster: str, config_hash: str) -> dict[str, Any] | None:
        key = (cluster, config_hash)
        if key not in self.cache:
            document = self.store.submitted_document(cluster, config_hash)
            if document is None:
                return None
            self.cache[key] = document
        return self.cache[key]

    def put(self, cluster: str, config_hash: str, document: dict[str, Any]) -> None:
        self.cache[(cluster, config_hash)] = document

    def forget(self, cluster: str) -> None:
        for key in [key for key in self.cache if key[0] == cluster]:
            del self.cache[key]


class Packages:
    """The code packages uploaded with `servekeeper apply`, by hash, in the state dir."""

    def __init__(self, packages_dir: Path) -> None:
        self.packages_dir = packages_dir

    def of(self, service: ServiceRecord) -> Package | None:
        return self.by_hash(service.package_hash) if service.package_hash is not None else None

    def by_hash(self, package_hash: str) -> Package:
        path = self.packages_dir / f"{package_hash}.zip"
        return Package(hash=package_hash, path=path, size=path.stat().st_size if path.exists() else 0)

    def uri(self, service: ServiceRecord) -> str | None:
        package = self.of(service)
        return package.uri if package else None
