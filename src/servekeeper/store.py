"""Everything servekeeper knows, in one SQLite file (WAL), behind a small typed interface.

Schema changes are explicit, numbered migrations tracked in `PRAGMA user_version`. Nothing
happens at import time; rows are plain values and JSON, never pickles.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from servekeeper.status import (
    ClusterPorts,
    ClusterRecord,
    ClusterRole,
    Condition,
    Event,
    ServiceRecord,
)

MIGRATIONS: list[str] = [
    # 1: services, clusters, events, small key/value facts (the ingress process, ...)
    """
    CREATE TABLE services (
        name TEXT PRIMARY KEY,
        spec_json TEXT NOT NULL,
        generation INTEGER NOT NULL,
        observed_generation INTEGER NOT NULL DEFAULT 0,
        deleting INTEGER NOT NULL DEFAULT 0,
        unhealthy_since REAL,
        failed_generation INTEGER,
        failure_reason TEXT,
        conditions_json TEXT NOT NULL DEFAULT '[]',
        created_at REAL NOT NULL
    );
    CREATE TABLE clusters (
        name TEXT PRIMARY KEY,
        service TEXT NOT NULL,
        generation INTEGER NOT NULL,
        cluster_spec_hash TEXT NOT NULL,
        cluster_spec_json TEXT NOT NULL,
        role TEXT NOT NULL,
        ports_json TEXT NOT NULL,
        temp_dir TEXT NOT NULL,
        log_dir TEXT NOT NULL,
        created_at REAL NOT NULL,
        head_pid INTEGER,
        worker_pids_json TEXT NOT NULL DEFAULT '[]',
        submitted_config_hash TEXT,
        applied_config_hash TEXT,
        config_submitted_at REAL,
        ready_at REAL,
        drain_started_at REAL,
        failure_reason TEXT
    );
    CREATE INDEX clusters_by_service ON clusters(service);
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        service TEXT NOT NULL,
        time REAL NOT NULL,
        type TEXT NOT NULL,
        reason TEXT NOT NULL,
        message TEXT NOT NULL
    );
    CREATE INDEX events_by_service ON events(service, id);
    CREATE TABLE facts (key TEXT PRIMARY KEY, value_json TEXT NOT NULL);
    """,
    # 2: an audit row per Serve config PUT, so "never submitted twice" can be checked
    """
    CREATE TABLE submissions (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        cluster TEXT NOT NULL,
        config_hash TEXT NOT NULL,
        time REAL NOT NULL
    );
    """,
]

SCHEMA_VERSION = len(MIGRATIONS)
EVENTS_KEPT_PER_SERVICE = 500


class StoreError(RuntimeError):
    """The store cannot be used (corrupt, unreadable, or from a newer servekeeper)."""


class Store:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._db = sqlite3.connect(str(path), timeout=10, isolation_level=None, check_same_thread=False)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            check = self._db.execute("PRAGMA quick_check").fetchone()[0]
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"the store {path} is unreadable or corrupt: {exc}; nothing was changed") from exc
        if check != "ok":
            raise StoreError(f"the store {path} failed its integrity check ({check}); nothing was changed")
        self._migrate()

    def close(self) -> None:
        self._db.close()

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        version = self.schema_version
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"the store {self.path} has schema version {version}, newer than this servekeeper "
                f"understands ({SCHEMA_VERSION}); upgrade servekeeper"
            )
        for number in range(version, SCHEMA_VERSION):
            with self.transaction() as db:
                db.executescript_in_tx(MIGRATIONS[number])
                db.execute(f"PRAGMA user_version = {number + 1}")

    @contextmanager
    def transaction(self) -> Iterator[_Tx]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield _Tx(self._db)
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # -- services ------------------------------------------------------------------------

    def get_service(self, name: str) -> ServiceRecord | None:
        row = self._db.execute("SELECT * FROM services WHERE name = ?", (name,)).fetchone()
        return _service_from_row(row) if row else None

    def list_services(self) -> list[ServiceRecord]:
        rows = self._db.execute("SELECT * FROM services ORDER BY name").fetchall()
        return [_service_from_row(row) for row in rows]

    def put_service(self, service: ServiceRecord) -> None:
        with self.transaction() as tx:
            tx.put_service(service)

    def apply_spec(self, name: str, spec_json: str, now: float) -> tuple[ServiceRecord, bool]:
        """Store a new desired spec. The generation moves only when the spec changed."""
        with self.transaction() as tx:
            current = self.get_service(name)
            if current is None:
                service = ServiceRecord(name=name, spec_json=spec_json, generation=1, created_at=now)
            elif current.spec_json == spec_json and not current.deleting:
                return current, False
            else:
                service = current.with_changes(spec_json=spec_json, generation=current.generation + 1, deleting=False)
            tx.put_service(service)
        return service, True

    def delete_service_row(self, name: str) -> None:
        with self.transaction() as tx:
            tx.execute("DELETE FROM services WHERE name = ?", (name,))

    # -- clusters ------------------------------------------------------------------------

    def list_clusters(self, service: str | None = None) -> list[ClusterRecord]:
        if service is None:
            rows = self._db.execute("SELECT * FROM clusters ORDER BY created_at, name").fetchall()
        else:
            rows = self._db.execute(
                "SELECT * FROM clusters WHERE service = ? ORDER BY created_at, name", (service,)
            ).fetchall()
        return [_cluster_from_row(row) for row in rows]

    def get_cluster(self, name: str) -> ClusterRecord | None:
        row = self._db.execute("SELECT * FROM clusters WHERE name = ?", (name,)).fetchone()
        return _cluster_from_row(row) if row else None

    def put_cluster(self, cluster: ClusterRecord) -> None:
        with self.transaction() as tx:
            tx.put_cluster(cluster)

    def update_cluster(self, name: str, **changes: Any) -> ClusterRecord:
        with self.transaction() as tx:
            current = self.get_cluster(name)
            if current is None:
                raise KeyError(name)
            updated = current.with_changes(**changes)
            tx.put_cluster(updated)
        return updated

    def remove_cluster(self, name: str) -> None:
        with self.transaction() as tx:
            tx.execute("DELETE FROM clusters WHERE name = ?", (name,))

    # -- events, submissions, facts ------------------------------------------------------

    def add_events(self, events: list[Event]) -> None:
        if not events:
            return
        with self.transaction() as tx:
            for event in events:
                tx.execute(
                    "INSERT INTO events (service, time, type, reason, message) VALUES (?, ?, ?, ?, ?)",
                    (event.service, event.time, event.type, event.reason, event.message),
                )
            for service in {event.service for event in events}:
                tx.execute(
                    "DELETE FROM events WHERE service = ? AND id NOT IN "
                    "(SELECT id FROM events WHERE service = ? ORDER BY id DESC LIMIT ?)",
                    (service, service, EVENTS_KEPT_PER_SERVICE),
                )

    def list_events(self, service: str | None = None, limit: int = 100) -> list[Event]:
        if service is None:
            rows = self._db.execute("SELECT * FROM events ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        else:
            rows = self._db.execute(
                "SELECT * FROM events WHERE service = ? ORDER BY id DESC LIMIT ?", (service, limit)
            ).fetchall()
        return [
            Event(service=r["service"], time=r["time"], type=r["type"], reason=r["reason"], message=r["message"])
            for r in reversed(rows)
        ]

    def record_submission(self, cluster: str, config_hash: str, now: float) -> None:
        with self.transaction() as tx:
            tx.execute(
                "INSERT INTO submissions (cluster, config_hash, time) VALUES (?, ?, ?)",
                (cluster, config_hash, now),
            )

    def list_submissions(self) -> list[tuple[str, str, float]]:
        rows = self._db.execute("SELECT cluster, config_hash, time FROM submissions ORDER BY id").fetchall()
        return [(r["cluster"], r["config_hash"], r["time"]) for r in rows]

    def get_fact(self, key: str) -> Any:
        row = self._db.execute("SELECT value_json FROM facts WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else None

    def set_fact(self, key: str, value: Any) -> None:
        with self.transaction() as tx:
            tx.execute(
                "INSERT INTO facts (key, value_json) VALUES (?, ?) "
                "ON CONFLICT(key) DO UPDATE SET value_json = excluded.value_json",
                (key, json.dumps(value)),
            )


class _Tx:
    """Writes inside one transaction."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> None:
        self._db.execute(sql, params)

    def executescript_in_tx(self, script: str) -> None:
        # executescript() would COMMIT first; run the statements one by one instead.
        for statement in script.split(";"):
            if statement.strip():
                self._db.execute(statement)

    def put_service(self, s: ServiceRecord) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO services (name, spec_json, generation, observed_generation, deleting, "
            "unhealthy_since, failed_generation, failure_reason, conditions_json, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                s.name,
                s.spec_json,
                s.generation,
                s.observed_generation,
                int(s.deleting),
                s.unhealthy_since,
                s.failed_generation,
                s.failure_reason,
                s.conditions_json(),
                s.created_at,
            ),
        )

    def put_cluster(self, c: ClusterRecord) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO clusters (name, service, generation, cluster_spec_hash, cluster_spec_json, "
            "role, ports_json, temp_dir, log_dir, created_at, head_pid, worker_pids_json, "
            "submitted_config_hash, applied_config_hash, config_submitted_at, ready_at, drain_started_at, "
            "failure_reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                c.name,
                c.service,
                c.generation,
                c.cluster_spec_hash,
                c.cluster_spec_json,
                c.role.value,
                json.dumps(c.ports.to_json()),
                c.temp_dir,
                c.log_dir,
                c.created_at,
                c.head_pid,
                json.dumps(list(c.worker_pids)),
                c.submitted_config_hash,
                c.applied_config_hash,
                c.config_submitted_at,
                c.ready_at,
                c.drain_started_at,
                c.failure_reason,
            ),
        )


def _service_from_row(row: sqlite3.Row) -> ServiceRecord:
    return ServiceRecord(
        name=row["name"],
        spec_json=row["spec_json"],
        generation=row["generation"],
        observed_generation=row["observed_generation"],
        deleting=bool(row["deleting"]),
        unhealthy_since=row["unhealthy_since"],
        failed_generation=row["failed_generation"],
        failure_reason=row["failure_reason"],
        conditions=tuple(Condition.from_json(c) for c in json.loads(row["conditions_json"])),
        created_at=row["created_at"],
    )


def _cluster_from_row(row: sqlite3.Row) -> ClusterRecord:
    return ClusterRecord(
        name=row["name"],
        service=row["service"],
        generation=row["generation"],
        cluster_spec_hash=row["cluster_spec_hash"],
        cluster_spec_json=row["cluster_spec_json"],
        role=ClusterRole(row["role"]),
        ports=ClusterPorts.from_json(json.loads(row["ports_json"])),
        temp_dir=row["temp_dir"],
        log_dir=row["log_dir"],
        created_at=row["created_at"],
        head_pid=row["head_pid"],
        worker_pids=tuple(json.loads(row["worker_pids_json"])),
        submitted_config_hash=row["submitted_config_hash"],
        applied_config_hash=row["applied_config_hash"],
        config_submitted_at=row["config_submitted_at"],
        ready_at=row["ready_at"],
        drain_started_at=row["drain_started_at"],
        failure_reason=row["failure_reason"],
    )
