"""What `Store.transaction()` gives its block: reads and writes inside that one transaction."""

from __future__ import annotations

import sqlite3
from typing import Any

from servekeeper.model.records import ClusterRecord, ServiceRecord
from servekeeper.store import clusters, revisions, services
from servekeeper.store.rows import rows_changed


class Transaction:
    """Reads and writes inside one transaction (see `Store.transaction`)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> None:
        self._db.execute(sql, params)

    def changes(self) -> int:
        """Rows changed by the last statement."""
        return rows_changed(self._db)

    def get_service(self, name: str) -> ServiceRecord | None:
        return services.get_service(self._db, name)

    def put_service(self, service: ServiceRecord) -> None:
        services.put_service(self._db, service)

    def update_status(self, service: ServiceRecord) -> None:
        """Write the controller-owned fields of `service` only; the rest of the row stays as stored."""
        services.update_status(self._db, service)

    def add_revision(self, service: ServiceRecord, cause: str, now: float, limit: int) -> None:
        revisions.add_revision(self._db, service, cause, now, limit)

    def get_cluster(self, name: str) -> ClusterRecord | None:
        return clusters.get_cluster(self._db, name)

    def put_cluster(self, cluster: ClusterRecord) -> None:
        clusters.put_cluster(self._db, cluster)

    def pending_cluster(self, service: str) -> ClusterRecord | None:
        return clusters.pending_cluster(self._db, service)
