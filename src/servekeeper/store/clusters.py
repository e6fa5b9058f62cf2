"""Clusters: each Ray cluster a service has, its role, ports, processes and progress, and the
commands an operator gave its canary. Functions take the connection; a read-modify-write must
run inside one transaction of the caller's (`Store` does that)."""

from __future__ import annotations

import sqlite3
from typing import Any

from servekeeper.model.enums import ClusterRole
from servekeeper.model.records import ClusterRecord
from servekeeper.store.rows import cluster_from_row, cluster_row, insert_or_replace


def list_clusters(db: sqlite3.Connection, service: str | None = None) -> list[ClusterRecord]:
    if service is None:
        rows = db.execute("SELECT * FROM clusters ORDER BY created_at, name").fetchall()
    else:
        rows = db.execute("SELECT * FROM clusters WHERE service = ? ORDER BY created_at, name", (service,)).fetchall()
    return [cluster_from_row(row) for row in rows]


def get_cluster(db: sqlite3.Connection, name: str) -> ClusterRecord | None:
    row = db.execute("SELECT * FROM clusters WHERE name = ?", (name,)).fetchone()
    return cluster_from_row(row) if row else None


def put_cluster(db: sqlite3.Connection, cluster: ClusterRecord) -> None:
    insert_or_replace(db, "clusters", cluster_row(cluster))


def update_cluster(db: sqlite3.Connection, name: str, changes: dict[str, Any]) -> ClusterRecord:
    current = get_cluster(db, name)
    if current is None:
        raise KeyError(name)
    updated = current.with_changes(**changes)
    put_cluster(db, updated)
    return updated


def remove_cluster(db: sqlite3.Connection, name: str) -> None:
    db.execute("DELETE FROM clusters WHERE name = ?", (name,))


def pending_cluster(db: sqlite3.Connection, service: str) -> ClusterRecord | None:
    """The service's newest pending cluster, if any."""
    row = db.execute(
        "SELECT * FROM clusters WHERE service = ? AND role = ? ORDER BY created_at DESC, name DESC LIMIT 1",
        (service, ClusterRole.PENDING.value),
    ).fetchone()
    return cluster_from_row(row) if row else None


def request_promote(db: sqlite3.Connection, service: str, full: bool) -> ClusterRecord | None:
    """Count a `promote` on the service's pending cluster (None: there is none)."""
    pending = pending_cluster(db, service)
    if pending is None:
        return None
    if full:
        updated = pending.with_changes(promote_full=True)
    else:
        updated = pending.with_changes(promote_requests=pending.promote_requests + 1)
    put_cluster(db, updated)
    return updated


def request_abort(db: sqlite3.Connection, service: str) -> ClusterRecord | None:
    """Flag the service's pending cluster for abort (None: there is none)."""
    pending = pending_cluster(db, service)
    if pending is None:
        return None
    updated = pending.with_changes(abort_requested=True)
    put_cluster(db, updated)
    return updated
