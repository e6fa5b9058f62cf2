"""Host pools (issue 10): the machines multi-host clusters run on, as applied. Functions take
the connection; `apply_host_pool` must run inside one transaction of the caller's."""

from __future__ import annotations

import sqlite3

from servekeeper.model.hostpool import HostPoolRecord
from servekeeper.store.rows import host_pool_from_row, host_pool_row, insert_or_replace, rows_changed


def get_host_pool(db: sqlite3.Connection, name: str) -> HostPoolRecord | None:
    row = db.execute("SELECT * FROM host_pools WHERE name = ?", (name,)).fetchone()
    return host_pool_from_row(row) if row else None


def list_host_pools(db: sqlite3.Connection) -> list[HostPoolRecord]:
    return [host_pool_from_row(row) for row in db.execute("SELECT * FROM host_pools ORDER BY name").fetchall()]


def apply_host_pool(db: sqlite3.Connection, name: str, spec_json: str, now: float) -> tuple[HostPoolRecord, bool]:
    """Store a pool's spec; returns the stored record and whether anything was written."""
    current = get_host_pool(db, name)
    if current is not None and current.spec_json == spec_json:
        return current, False
    record = HostPoolRecord(
        name=name, spec_json=spec_json, created_at=current.created_at if current else now, updated_at=now
    )
    insert_or_replace(db, "host_pools", host_pool_row(record))
    return record, True


def delete_host_pool(db: sqlite3.Connection, name: str) -> bool:
    db.execute("DELETE FROM host_pools WHERE name = ?", (name,))
    return rows_changed(db) > 0
