"""Everything servekeeper knows, in one SQLite file (WAL), behind a small typed interface.

The parts, for a newcomer: `schema.py` holds the tables, as numbered migrations; `rows.py` turns
rows into records and back. What was declared (`services.py`: each service's spec and
generation, and the status the controller last persisted for it; `revisions.py`: the history of
its specs; `host_pools.py`) lives beside what the controller made and saw (`clusters.py`,
`submissions.py`, `events.py`, `facts.py`). Each of those modules is SQL on a connection. This
one, `Store`, owns the connections and the transactions, and is the interface the rest of
servekeeper uses. Nothing happens at import time.

Any thread may use a Store: each thread gets its own connection, and SQLite's file locking
does the rest (WAL lets readers run beside the one writer; `busy_timeout` makes a writer wait
for the lock instead of failing). Every write is one `BEGIN IMMEDIATE` transaction, which takes
the write lock before its first read, so a read-modify-write (`apply_spec`, `mark_deleting`,
`persist_status`, `update_cluster`) is atomic against every other thread and process.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from servekeeper.model.hostpool import HostPoolRecord
from servekeeper.model.records import ClusterRecord, Event, Revision, ServiceRecord
from servekeeper.model.spec import ServiceSpec
from servekeeper.store import clusters, facts, host_pools, revisions, services, submissions
from servekeeper.store import events as event_log
from servekeeper.store.schema import MIGRATIONS, SCHEMA_VERSION, apply_migration, schema_version
from servekeeper.store.transaction import Transaction

BUSY_TIMEOUT_MS = 10_000

logger = logging.getLogger(__name__)


class StoreError(RuntimeError):
    """The store cannot be used (corrupt, unreadable, closed, or from a newer servekeeper)."""


def private_state_dir(state_dir: Path) -> Path:
    """The state dir, created 0700 (with its missing parents), and made 0700 if an older
    servekeeper, or a umask, left it open to others: it holds the token, store and secrets.
    StoreError for a dir another user owns (never chmod-ed, even as root) or one we cannot make;
    a warning names a dir that was tightened (`--state-dir .` would be the working folder)."""
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        status = os.stat(state_dir)
    except OSError as exc:
        raise StoreError(f"cannot make the state dir {state_dir}: {exc.strerror or exc}") from exc
    if status.st_uid != os.geteuid():
        raise StoreError(
            f"the state dir {state_dir} is owned by uid {status.st_uid}, not by this user (uid {os.geteuid()}); "
            "use a state dir of your own (--state-dir)"
        )
    if status.st_mode & 0o077:
        logger.warning(
            "state dir %s was mode %04o, open to others; made 0700 (it holds the API token, store and secrets)",
            state_dir,
            stat.S_IMODE(status.st_mode),
        )
        os.chmod(state_dir, 0o700)
    return state_dir


def _tighten_database_files(path: Path) -> None:
    """0600 on every open: a store.db (and its -wal, -shm) from before this rule may be 0644."""
    for name in (path.name, f"{path.name}-wal", f"{path.name}-shm"):
        try:
            if os.stat(path.parent / name).st_mode & 0o077:
                os.chmod(path.parent / name, 0o600)
        except FileNotFoundError:
            continue


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
        private_state_dir(path.parent)
        if not path.exists():
            # Specs hold env values (and imported secrets): readable by the owner only. SQLite
            # gives its -wal and -shm files the mode of the database file.
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        _tighten_database_files(path)
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

    @property
    def schema_version(self) -> int:
        return schema_version(self._connection())

    def _migrate(self) -> None:
        version = self.schema_version
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"the store {self.path} has schema version {version}, newer than this servekeeper "
                f"understands ({SCHEMA_VERSION}); upgrade servekeeper"
            )
        while version < SCHEMA_VERSION:
            with self._writing() as db:
                # Read again under the write lock: another process may have just migrated.
                version = schema_version(db)
                if version < SCHEMA_VERSION:
                    apply_migration(db, MIGRATIONS[version])  # MIGRATIONS[n] has version n + 1
                    version += 1

    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """One write transaction on this thread's connection. `BEGIN IMMEDIATE` takes the
        write lock first, so whatever the block reads through the `Transaction` stays true until
        it commits. Used again inside a transaction on the same thread, it is a savepoint. Never
        `await` inside: coroutines on one loop share the thread, and so its transaction."""
        db = self._connection()
        state = self._thread
        if state.transaction_depth > 0:
            db.execute("SAVEPOINT nested")
            state.transaction_depth += 1
            try:
                yield Transaction(db)
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
            yield Transaction(db)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        finally:
            state.transaction_depth = 0

    @contextmanager
    def _writing(self) -> Iterator[sqlite3.Connection]:
        """This thread's connection, inside one `transaction()`."""
        with self.transaction():
            yield self._connection()

    # -- services and their revisions (the desired state) --------------------------------

    def get_service(self, name: str) -> ServiceRecord | None:
        return services.get_service(self._connection(), name)

    def list_services(self) -> list[ServiceRecord]:
        return services.list_services(self._connection())

    def declared_ports(self) -> set[int]:
        """The ports every service's ingress declares: its own even while nothing listens on
        them yet (a first rollout binds them only once its cluster is ready)."""
        return {
            port
            for service in self.list_services()
            for port in ServiceSpec.model_validate_json(service.spec_json).spec.ingress.ports()
        }

    def put_service(self, service: ServiceRecord) -> None:
        with self._writing() as db:
            services.put_service(db, service)

    def apply_spec(
        self,
        name: str,
        spec_json: str,
        now: float,
        package_hash: str | None = None,
        cause: str = "apply",
        history_limit: int = 10,
    ) -> tuple[ServiceRecord, bool]:
        """Store a new desired spec, and a revision if the generation moved (`services.apply_spec`).
        Returns the stored record and whether anything was written."""
        with self._writing() as db:
            return services.apply_spec(db, name, spec_json, now, package_hash, cause, history_limit)

    def mark_deleting(self, name: str) -> ServiceRecord | None:
        """Set the deleting flag and nothing else. None if there is no such service."""
        with self._writing() as db:
            return services.mark_deleting(db, name)

    def persist_status(
        self, name: str, expected_generation: int, expected_deleting: bool, **controller_owned_fields: Any
    ) -> bool:
        """Compare-and-set of the controller-owned fields (`services.CONTROLLER_OWNED_FIELDS`):
        written only if the row still has `expected_generation` and `expected_deleting`, and only
        if a value changed. Returns whether it wrote."""
        fields = services.controller_owned(controller_owned_fields)
        with self._writing() as db:
            return services.persist_status(db, name, expected_generation, expected_deleting, fields)

    def delete_service_row(self, name: str, expected_generation: int | None = None) -> bool:
        """Forget a deleted service. With `expected_generation`, only if the row is still that
        generation and marked deleting: an apply stored meanwhile is never lost."""
        with self._writing() as db:
            return services.delete_service(db, name, expected_generation)

    def list_revisions(self, service: str) -> list[Revision]:
        return revisions.list_revisions(self._connection(), service)

    def get_revision(self, service: str, revision: int) -> Revision | None:
        return revisions.get_revision(self._connection(), service, revision)

    def end_revision(self, service: str, revision: int, outcome: str, ended_by: str, message: str, now: float) -> bool:
        """Record how a revision's rollout ended, once: the first ending stands."""
        with self._writing() as db:
            return revisions.end_revision(db, service, revision, outcome, ended_by, message, now)

    # -- clusters (the observed state) ---------------------------------------------------

    def list_clusters(self, service: str | None = None) -> list[ClusterRecord]:
        return clusters.list_clusters(self._connection(), service)

    def get_cluster(self, name: str) -> ClusterRecord | None:
        return clusters.get_cluster(self._connection(), name)

    def put_cluster(self, cluster: ClusterRecord) -> None:
        with self._writing() as db:
            clusters.put_cluster(db, cluster)

    def update_cluster(self, name: str, **changes: Any) -> ClusterRecord:
        """The cluster with `changes` applied and stored; KeyError if there is no such cluster."""
        with self._writing() as db:
            return clusters.update_cluster(db, name, changes)

    def request_promote(self, service: str, full: bool) -> ClusterRecord | None:
        """Count a `promote` on the service's pending cluster (None: there is none)."""
        with self._writing() as db:
            return clusters.request_promote(db, service, full)

    def request_abort(self, service: str) -> ClusterRecord | None:
        """Flag the service's pending cluster for abort (None: there is none)."""
        with self._writing() as db:
            return clusters.request_abort(db, service)

    def remove_cluster(self, name: str) -> None:
        """Forget a stopped cluster, and the audit of the configs sent to it."""
        with self._writing() as db:
            clusters.remove_cluster(db, name)
            submissions.forget_cluster_submissions(db, name)

    # -- events, submissions, facts ------------------------------------------------------

    def add_events(self, events: list[Event]) -> None:
        if not events:
            return
        with self._writing() as db:
            event_log.add_events(db, events)

    def list_events(self, service: str | None = None, limit: int = 100) -> list[Event]:
        return event_log.list_events(self._connection(), service, limit)

    def record_submission(self, cluster: str, config_hash: str, now: float, document_json: str | None = None) -> None:
        with self._writing() as db:
            submissions.record_submission(db, cluster, config_hash, now, document_json)

    def count_submissions(self, cluster: str, config_hash: str) -> int:
        return submissions.count_submissions(self._connection(), cluster, config_hash)

    def submitted_document(self, cluster: str, config_hash: str) -> dict[str, Any] | None:
        """The Serve config document last PUT to `cluster` under `config_hash`, if any."""
        return submissions.submitted_document(self._connection(), cluster, config_hash)

    def list_submissions(self) -> list[tuple[str, str, float]]:
        return submissions.list_submissions(self._connection())

    def get_fact(self, key: str) -> Any:
        return facts.get_fact(self._connection(), key)

    def set_fact(self, key: str, value: Any) -> None:
        with self._writing() as db:
            facts.set_fact(db, key, value)

    # -- host pools ----------------------------------------------------------------------

    def apply_host_pool(self, name: str, spec_json: str, now: float) -> tuple[HostPoolRecord, bool]:
        """Store a pool's spec; returns the stored record and whether anything was written."""
        with self._writing() as db:
            return host_pools.apply_host_pool(db, name, spec_json, now)

    def get_host_pool(self, name: str) -> HostPoolRecord | None:
        return host_pools.get_host_pool(self._connection(), name)

    def list_host_pools(self) -> list[HostPoolRecord]:
        return host_pools.list_host_pools(self._connection())

    def delete_host_pool(self, name: str) -> bool:
        with self._writing() as db:
            return host_pools.delete_host_pool(db, name)


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
