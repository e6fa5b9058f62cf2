"""Everything servekeeper knows, in one SQLite file (WAL), behind a small typed interface.

Schema changes are explicit, numbered migrations tracked in `PRAGMA user_version`. Nothing
happens at import time; rows are plain values and JSON, never pickles.

Any thread may use a Store: each thread gets its own connection, and SQLite's file locking
does the rest (WAL lets readers run beside the one writer; `busy_timeout` makes a writer wait
for the lock instead of failing). Every write is one `BEGIN IMMEDIATE` transaction, which takes
the write lock before its first read, so a read-modify-write (`apply_spec`, `mark_deleting`,
`persist_status`, `update_cluster`) is atomic against every other thread and process.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from servekeeper.model.hostpool import HostPoolRecord
from servekeeper.model.status import (
    CanaryState,
    ClusterPorts,
    ClusterRecord,
    ClusterRole,
    Condition,
    Event,
    NodePlacement,
    Revision,
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
    # 3: the hash of the code package a spec points at: a code-only change is a new generation
    """
    ALTER TABLE services ADD COLUMN package_hash TEXT;
    ALTER TABLE clusters ADD COLUMN package_hash TEXT;
    """,
    # 4: the document of each PUT (to recognise it in Ray's answers, and to restore it), and
    #    per cluster the last config seen running well
    """
    ALTER TABLE submissions ADD COLUMN document_json TEXT;
    ALTER TABLE clusters ADD COLUMN good_config_hash TEXT;
    """,
    # 5: progressive delivery: a canary's progress (controller-owned) and the commands an
    #    operator gave it (API-owned counters, so that a command given mid-tick is never lost);
    #    one row per generation of a service, for history and undo
    """
    ALTER TABLE clusters ADD COLUMN canary_json TEXT;
    ALTER TABLE clusters ADD COLUMN promote_requests INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE clusters ADD COLUMN promote_full INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE clusters ADD COLUMN abort_requested INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE clusters ADD COLUMN target_capacity REAL;
    CREATE TABLE revisions (
        service TEXT NOT NULL,
        revision INTEGER NOT NULL,
        spec_json TEXT NOT NULL,
        spec_hash TEXT NOT NULL,
        package_hash TEXT,
        created_at REAL NOT NULL,
        cause TEXT NOT NULL,
        outcome TEXT NOT NULL,
        ended_at REAL,
        ended_by TEXT,
        message TEXT,
        PRIMARY KEY (service, revision)
    );
    """,
    # 6: host pools (issue 10): the machines multi-host clusters run on, as applied
    """
    CREATE TABLE host_pools (
        name TEXT PRIMARY KEY,
        spec_json TEXT NOT NULL,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    """,
]

MIGRATIONS.append(
    # 7: clusters on a host pool: the pool, and each node's host, ports and process
    """
    ALTER TABLE clusters ADD COLUMN pool TEXT;
    ALTER TABLE clusters ADD COLUMN nodes_json TEXT NOT NULL DEFAULT '[]';
    """
)
SCHEMA_VERSION = len(MIGRATIONS)
PROGRESSING = "Progressing"  # a revision's outcome while it rolls out
SUPERSEDED = "Superseded"
EVENTS_KEPT_PER_SERVICE = 500
BUSY_TIMEOUT_MS = 10_000

# The fields of a service row that only the controller writes (the API owns the spec, the
# generation and the deleting flag). `persist_status` writes these and nothing else.
CONTROLLER_OWNED_FIELDS = frozenset(
    {"observed_generation", "unhealthy_since", "failed_generation", "failure_reason", "conditions"}
)


class StoreError(RuntimeError):
    """The store cannot be used (corrupt, unreadable, closed, or from a newer servekeeper)."""


class _ThreadState(threading.local):
    db: sqlite3.Connection | None = None
    transaction_depth: int = 0


class Store:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._thread = _ThreadState()
        # Every connection opened, by owning thread, so close() can close them all.
        self._connections: dict[threading.Thread, sqlite3.Connection] = {}
        self._connections_lock = threading.Lock()
        self._closed = False
        if not path.exists():
            # Specs hold env values (and imported secrets): readable by the owner only. SQLite
            # gives its -wal and -shm files the mode of the database file.
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        try:
            try:
                db = self._connection()
                db.execute("PRAGMA journal_mode=WAL")  # persistent: set once, in the file
                check = db.execute("PRAGMA quick_check").fetchone()[0]
            except sqlite3.DatabaseError as exc:
                raise StoreError(f"the store {path} is unreadable or corrupt: {exc}; nothing was changed") from exc
            if check != "ok":
                raise StoreError(f"the store {path} failed its integrity check ({check}); nothing was changed")
            self._migrate()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close every connection this store opened, on every thread. Call it once nothing
        else uses the store; any later call raises StoreError."""
        with self._connections_lock:
            self._closed = True
            connections = list(self._connections.values())
            self._connections.clear()
        for db in connections:
            db.close()

    def _connection(self) -> sqlite3.Connection:
        if self._closed:
            raise StoreError(f"the store {self.path} is closed")
        db = self._thread.db
        if db is None:
            with self._connections_lock:
                if self._closed:
                    raise StoreError(f"the store {self.path} is closed")
                self._close_connections_of_finished_threads()
                db = _connect(self.path)
                self._connections[threading.current_thread()] = db
            self._thread.db = db
        return db

    def _close_connections_of_finished_threads(self) -> None:
        # A finished thread can no longer be using its connection; without this, a caller
        # that makes short-lived threads would leak one connection per thread.
        for thread in [t for t in self._connections if not t.is_alive()]:
            self._connections.pop(thread).close()

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        return self._connection().execute(sql, params).fetchall()

    @property
    def schema_version(self) -> int:
        return int(self._read("PRAGMA user_version")[0][0])

    def _migrate(self) -> None:
        version = self.schema_version
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"the store {self.path} has schema version {version}, newer than this servekeeper "
                f"understands ({SCHEMA_VERSION}); upgrade servekeeper"
            )
        while version < SCHEMA_VERSION:
            with self.transaction() as tx:
                # Read again under the write lock: another process may have just migrated.
                version = tx.schema_version()
                if version < SCHEMA_VERSION:
                    tx.executescript_in_tx(MIGRATIONS[version])
                    tx.execute(f"PRAGMA user_version = {version + 1}")
                    version += 1

    @contextmanager
    def transaction(self) -> Iterator[_Tx]:
        """One write transaction on this thread's connection. `BEGIN IMMEDIATE` takes the
        write lock first, so whatever the block reads through the `_Tx` stays true until it
        commits. Used again inside a transaction on the same thread, it is a savepoint. Never
        `await` inside: coroutines on one loop share the thread, and so its transaction."""
        db = self._connection()
        state = self._thread
        if state.transaction_depth > 0:
            db.execute("SAVEPOINT nested")
            state.transaction_depth += 1
            try:
                yield _Tx(db)
            except BaseException:
                db.execute("ROLLBACK TO nested")
                db.execute("RELEASE nested")
                raise
            finally:
                state.transaction_depth -= 1
            db.execute("RELEASE nested")
            return
        if db.in_transaction:  # left open by a failed COMMIT: never build on it
            db.execute("ROLLBACK")
        db.execute("BEGIN IMMEDIATE")
        state.transaction_depth = 1
        try:
            yield _Tx(db)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        finally:
            state.transaction_depth = 0

    # -- services ------------------------------------------------------------------------

    def get_service(self, name: str) -> ServiceRecord | None:
        return _select_service(self._connection(), name)

    def list_services(self) -> list[ServiceRecord]:
        return [_service_from_row(row) for row in self._read("SELECT * FROM services ORDER BY name")]

    def put_service(self, service: ServiceRecord) -> None:
        with self.transaction() as tx:
            tx.put_service(service)

    def apply_spec(
        self,
        name: str,
        spec_json: str,
        now: float,
        package_hash: str | None = None,
        cause: str = "apply",
        history_limit: int = 10,
    ) -> tuple[ServiceRecord, bool]:
        """Store a new desired spec. The generation moves only when the spec or the code
        package changed (or the service was being deleted): a code-only change is a new
        generation too, and each generation is a revision in the service's history (`cause`
        says what made it). Returns the stored record and whether anything was written."""
        with self.transaction() as tx:
            current = tx.get_service(name)
            if current is None:
                service = ServiceRecord(
                    name=name, spec_json=spec_json, generation=1, created_at=now, package_hash=package_hash
                )
            elif current.spec_json == spec_json and current.package_hash == package_hash and not current.deleting:
                return current, False
            else:
                service = current.with_changes(
                    spec_json=spec_json, generation=current.generation + 1, deleting=False, package_hash=package_hash
                )
            tx.put_service(service)
            tx.add_revision(service, cause, now, history_limit)
        return service, True

    def mark_deleting(self, name: str) -> ServiceRecord | None:
        """Set the deleting flag and nothing else. None if there is no such service."""
        with self.transaction() as tx:
            current = tx.get_service(name)
            if current is None or current.deleting:
                return current
            tx.execute("UPDATE services SET deleting = 1 WHERE name = ?", (name,))
        return current.with_changes(deleting=True)

    def persist_status(
        self, name: str, expected_generation: int, expected_deleting: bool, **controller_owned_fields: Any
    ) -> bool:
        """Compare-and-set of the controller-owned fields (CONTROLLER_OWNED_FIELDS): written
        only if the row still has `expected_generation` and `expected_deleting` (the API may
        have stored a new spec or a delete since the caller read it, and that must win) and
        only if a value changed. Returns whether it wrote."""
        unknown = set(controller_owned_fields) - CONTROLLER_OWNED_FIELDS
        if unknown:
            raise TypeError(f"persist_status writes only {sorted(CONTROLLER_OWNED_FIELDS)}, not {sorted(unknown)}")
        if "conditions" in controller_owned_fields:
            controller_owned_fields["conditions"] = tuple(controller_owned_fields["conditions"])
        with self.transaction() as tx:
            current = tx.get_service(name)
            if current is None or current.generation != expected_generation or current.deleting != expected_deleting:
                return False
            updated = current.with_changes(**controller_owned_fields)
            if updated == current:
                return False
            tx.update_status(updated)
        return True

    def delete_service_row(self, name: str, expected_generation: int | None = None) -> bool:
        """Forget a deleted service. With `expected_generation`, only if the row is still that
        generation and marked deleting: an apply stored meanwhile is never lost."""
        with self.transaction() as tx:
            if expected_generation is None:
                tx.execute("DELETE FROM services WHERE name = ?", (name,))
            else:
                tx.execute(
                    "DELETE FROM services WHERE name = ? AND generation = ? AND deleting = 1",
                    (name, expected_generation),
                )
            deleted = tx.changes() > 0
            if deleted:
                tx.execute("DELETE FROM revisions WHERE service = ?", (name,))
            return deleted

    # -- clusters ------------------------------------------------------------------------

    def list_clusters(self, service: str | None = None) -> list[ClusterRecord]:
        if service is None:
            rows = self._read("SELECT * FROM clusters ORDER BY created_at, name")
        else:
            rows = self._read("SELECT * FROM clusters WHERE service = ? ORDER BY created_at, name", (service,))
        return [_cluster_from_row(row) for row in rows]

    def get_cluster(self, name: str) -> ClusterRecord | None:
        return _select_cluster(self._connection(), name)

    def put_cluster(self, cluster: ClusterRecord) -> None:
        with self.transaction() as tx:
            tx.put_cluster(cluster)

    def update_cluster(self, name: str, **changes: Any) -> ClusterRecord:
        with self.transaction() as tx:
            current = tx.get_cluster(name)
            if current is None:
                raise KeyError(name)
            updated = current.with_changes(**changes)
            tx.put_cluster(updated)
        return updated

    def request_promote(self, service: str, full: bool) -> ClusterRecord | None:
        """Count a `promote` on the service's pending cluster (None: there is none)."""
        with self.transaction() as tx:
            pending = tx.pending_cluster(service)
            if pending is None:
                return None
            if full:
                updated = pending.with_changes(promote_full=True)
            else:
                updated = pending.with_changes(promote_requests=pending.promote_requests + 1)
            tx.put_cluster(updated)
        return updated

    def request_abort(self, service: str) -> ClusterRecord | None:
        """Flag the service's pending cluster for abort (None: there is none)."""
        with self.transaction() as tx:
            pending = tx.pending_cluster(service)
            if pending is None:
                return None
            updated = pending.with_changes(abort_requested=True)
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
            rows = self._read("SELECT * FROM events ORDER BY id DESC LIMIT ?", (limit,))
        else:
            rows = self._read("SELECT * FROM events WHERE service = ? ORDER BY id DESC LIMIT ?", (service, limit))
        return [
            Event(service=r["service"], time=r["time"], type=r["type"], reason=r["reason"], message=r["message"])
            for r in reversed(rows)
        ]

    def record_submission(self, cluster: str, config_hash: str, now: float, document_json: str | None = None) -> None:
        with self.transaction() as tx:
            tx.execute(
                "INSERT INTO submissions (cluster, config_hash, time, document_json) VALUES (?, ?, ?, ?)",
                (cluster, config_hash, now, document_json),
            )

    def count_submissions(self, cluster: str, config_hash: str) -> int:
        rows = self._read(
            "SELECT COUNT(*) FROM submissions WHERE cluster = ? AND config_hash = ?", (cluster, config_hash)
        )
        return int(rows[0][0])

    def submitted_document(self, cluster: str, config_hash: str) -> dict[str, Any] | None:
        """The Serve config document last PUT to `cluster` under `config_hash`, if any."""
        rows = self._read(
            "SELECT document_json FROM submissions WHERE cluster = ? AND config_hash = ? "
            "AND document_json IS NOT NULL ORDER BY id DESC LIMIT 1",
            (cluster, config_hash),
        )
        return dict(json.loads(rows[0][0])) if rows else None

    def list_submissions(self) -> list[tuple[str, str, float]]:
        rows = self._read("SELECT cluster, config_hash, time FROM submissions ORDER BY id")
        return [(r["cluster"], r["config_hash"], r["time"]) for r in rows]

    # -- revisions -----------------------------------------------------------------------

    def list_revisions(self, service: str) -> list[Revision]:
        rows = self._read("SELECT * FROM revisions WHERE service = ? ORDER BY revision", (service,))
        return [_revision_from_row(row) for row in rows]

    def get_revision(self, service: str, revision: int) -> Revision | None:
        rows = self._read("SELECT * FROM revisions WHERE service = ? AND revision = ?", (service, revision))
        return _revision_from_row(rows[0]) if rows else None

    def end_revision(self, service: str, revision: int, outcome: str, ended_by: str, message: str, now: float) -> bool:
        """Record how a revision's rollout ended, once: the first ending stands."""
        with self.transaction() as tx:
            tx.execute(
                "UPDATE revisions SET outcome = ?, ended_by = ?, message = ?, ended_at = ? "
                "WHERE service = ? AND revision = ? AND outcome = ?",
                (outcome, ended_by, message, now, service, revision, PROGRESSING),
            )
            return tx.changes() > 0

    def get_fact(self, key: str) -> Any:
        rows = self._read("SELECT value_json FROM facts WHERE key = ?", (key,))
        return json.loads(rows[0][0]) if rows else None

    def set_fact(self, key: str, value: Any) -> None:
        with self.transaction() as tx:
            tx.execute(
                "INSERT INTO facts (key, value_json) VALUES (?, ?) "
                "ON CONFLICT(key) DO UPDATE SET value_json = excluded.value_json",
                (key, json.dumps(value)),
            )

    # -- host pools ----------------------------------------------------------------------

    def apply_host_pool(self, name: str, spec_json: str, now: float) -> tuple[HostPoolRecord, bool]:
        """Store a pool's spec; returns the stored record and whether anything was written."""
        with self.transaction() as tx:
            current = _select_host_pool(self._connection(), name)  # this transaction's connection
            if current is not None and current.spec_json == spec_json:
                return current, False
            record = HostPoolRecord(
                name=name,
                spec_json=spec_json,
                created_at=current.created_at if current else now,
                updated_at=now,
            )
            tx.execute(
                "INSERT OR REPLACE INTO host_pools (name, spec_json, created_at, updated_at) VALUES (?, ?, ?, ?)",
                (record.name, record.spec_json, record.created_at, record.updated_at),
            )
        return record, True

    def get_host_pool(self, name: str) -> HostPoolRecord | None:
        return _select_host_pool(self._connection(), name)

    def list_host_pools(self) -> list[HostPoolRecord]:
        return [_host_pool_from_row(row) for row in self._read("SELECT * FROM host_pools ORDER BY name")]

    def delete_host_pool(self, name: str) -> bool:
        with self.transaction() as tx:
            tx.execute("DELETE FROM host_pools WHERE name = ?", (name,))
            return tx.changes() > 0


class _Tx:
    """Reads and writes inside one transaction."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> None:
        self._db.execute(sql, params)

    def changes(self) -> int:
        """Rows changed by the last statement."""
        return int(self._db.execute("SELECT changes()").fetchone()[0])

    def executescript_in_tx(self, script: str) -> None:
        # executescript() would COMMIT first; run the statements one by one instead.
        for statement in script.split(";"):
            if statement.strip():
                self._db.execute(statement)

    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def pending_cluster(self, service: str) -> ClusterRecord | None:
        row = self._db.execute(
            "SELECT * FROM clusters WHERE service = ? AND role = ? ORDER BY created_at DESC, name DESC LIMIT 1",
            (service, ClusterRole.PENDING.value),
        ).fetchone()
        return _cluster_from_row(row) if row else None

    def add_revision(self, service: ServiceRecord, cause: str, now: float, limit: int) -> None:
        """A new generation: the one still rolling out is superseded, the oldest beyond `limit` go."""
        self._db.execute(
            "UPDATE revisions SET outcome = ?, ended_by = ?, ended_at = ? WHERE service = ? AND outcome = ?",
            (SUPERSEDED, f"revision {service.generation}", now, service.name, PROGRESSING),
        )
        spec_hash = hashlib.sha256(service.spec_json.encode()).hexdigest()[:16]
        self._db.execute(
            "INSERT OR REPLACE INTO revisions (service, revision, spec_json, spec_hash, package_hash, created_at, "
            "cause, outcome) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                service.name,
                service.generation,
                service.spec_json,
                spec_hash,
                service.package_hash,
                now,
                cause,
                PROGRESSING,
            ),
        )
        self._db.execute(
            "DELETE FROM revisions WHERE service = ? AND revision <= ?", (service.name, service.generation - limit)
        )

    def get_service(self, name: str) -> ServiceRecord | None:
        return _select_service(self._db, name)

    def get_cluster(self, name: str) -> ClusterRecord | None:
        return _select_cluster(self._db, name)

    def put_service(self, s: ServiceRecord) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO services (name, spec_json, generation, observed_generation, deleting, "
            "unhealthy_since, failed_generation, failure_reason, conditions_json, created_at, package_hash) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
                s.package_hash,
            ),
        )

    def update_status(self, s: ServiceRecord) -> None:
        """Write the controller-owned fields of `s` only; the rest of the row stays as stored."""
        self._db.execute(
            "UPDATE services SET observed_generation = ?, unhealthy_since = ?, failed_generation = ?, "
            "failure_reason = ?, conditions_json = ? WHERE name = ?",
            (
                s.observed_generation,
                s.unhealthy_since,
                s.failed_generation,
                s.failure_reason,
                s.conditions_json(),
                s.name,
            ),
        )

    def put_cluster(self, c: ClusterRecord) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO clusters (name, service, generation, cluster_spec_hash, cluster_spec_json, "
            "role, ports_json, temp_dir, log_dir, created_at, head_pid, worker_pids_json, "
            "submitted_config_hash, applied_config_hash, config_submitted_at, ready_at, drain_started_at, "
            "failure_reason, package_hash, good_config_hash, canary_json, promote_requests, promote_full, "
            "abort_requested, target_capacity, pool, nodes_json) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
                c.package_hash,
                c.good_config_hash,
                c.canary.to_json() if c.canary is not None else None,
                c.promote_requests,
                int(c.promote_full),
                int(c.abort_requested),
                c.target_capacity,
                c.pool,
                json.dumps([node.to_json() for node in c.nodes]),
            ),
        )


def _connect(path: Path) -> sqlite3.Connection:
    # check_same_thread=False only so that close() may close another thread's connection;
    # otherwise each connection is used by the one thread that opened it.
    db = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False)
    try:
        db.row_factory = sqlite3.Row
        db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA foreign_keys=ON")
    except BaseException:
        db.close()
        raise
    return db


def _select_host_pool(db: sqlite3.Connection, name: str) -> HostPoolRecord | None:
    row = db.execute("SELECT * FROM host_pools WHERE name = ?", (name,)).fetchone()
    return _host_pool_from_row(row) if row else None


def _host_pool_from_row(row: sqlite3.Row) -> HostPoolRecord:
    return HostPoolRecord(
        name=row["name"], spec_json=row["spec_json"], created_at=row["created_at"], updated_at=row["updated_at"]
    )


def _select_service(db: sqlite3.Connection, name: str) -> ServiceRecord | None:
    row = db.execute("SELECT * FROM services WHERE name = ?", (name,)).fetchone()
    return _service_from_row(row) if row else None


def _select_cluster(db: sqlite3.Connection, name: str) -> ClusterRecord | None:
    row = db.execute("SELECT * FROM clusters WHERE name = ?", (name,)).fetchone()
    return _cluster_from_row(row) if row else None


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
        package_hash=row["package_hash"],
    )


def _revision_from_row(row: sqlite3.Row) -> Revision:
    return Revision(
        service=row["service"],
        revision=row["revision"],
        spec_json=row["spec_json"],
        spec_hash=row["spec_hash"],
        package_hash=row["package_hash"],
        created_at=row["created_at"],
        cause=row["cause"],
        outcome=row["outcome"],
        ended_at=row["ended_at"],
        ended_by=row["ended_by"],
        message=row["message"],
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
        package_hash=row["package_hash"],
        good_config_hash=row["good_config_hash"],
        canary=CanaryState.from_json(row["canary_json"]) if row["canary_json"] else None,
        promote_requests=row["promote_requests"],
        promote_full=bool(row["promote_full"]),
        abort_requested=bool(row["abort_requested"]),
        target_capacity=row["target_capacity"],
        pool=row["pool"],
        nodes=tuple(NodePlacement.from_json(node) for node in json.loads(row["nodes_json"])),
    )
