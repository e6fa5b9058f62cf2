"""The store's schema: every change to it, in order, as numbered migrations.

A store's version is `PRAGMA user_version`: the number of the last migration it has. Opening a
store runs the ones it lacks, each in the write transaction that also bumps the version; a new
column or table is a new migration at the end of MIGRATIONS, never an edit of an old one (stores
in the field have run those already).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from servekeeper.store.facts import import_fact_key


@dataclass(frozen=True)
class Migration:
    version: int  # the store's user_version once it has run
    purpose: str
    script: str  # statements separated by ";"
    # What SQL cannot say simply (reading JSON documents), run after the script in its transaction.
    then: Callable[[sqlite3.Connection], None] | None = None


def _group_env_names(spec_json: str) -> dict[str, set[str]]:
    """Group ("head" or a worker group's name) -> its env names, read from a stored spec as JSON
    (an old spec need not validate against today's model)."""
    try:
        config = json.loads(spec_json)["spec"]["rayClusterConfig"]
    except (ValueError, KeyError, TypeError):
        return {}
    if not isinstance(config, dict):
        return {}
    groups: list[tuple[str, Any]] = [("head", config.get("head"))]
    groups += [(str(group.get("name")), group) for group in config.get("workerGroups") or [] if isinstance(group, dict)]
    return {name: set((group or {}).get("env") or {}) for name, group in groups if isinstance(group, dict)}


def _backfill_revision_secret_refs(db: sqlite3.Connection) -> None:
    """Each stored revision of an imported service gets, as its own import fact, the service's
    secret references of the env names the revision's spec holds: before migration 8 only the
    current generation had them, and `undo` to an older revision restored none (its export
    printed the values). A revision that already has its fact keeps it."""
    imported = db.execute(
        "SELECT services.name, facts.value_json FROM services JOIN facts ON facts.key = 'import:' || services.name"
    ).fetchall()
    for service, value_json in imported:
        fact = json.loads(value_json)
        refs = fact.get("secretRefs") if isinstance(fact, dict) else None
        if not refs:
            continue
        revisions = db.execute("SELECT revision, spec_json FROM revisions WHERE service = ?", (service,)).fetchall()
        for revision, spec_json in revisions:
            env_names = _group_env_names(spec_json)
            kept = [ref for ref in refs if ref.get("env") in env_names.get(ref.get("group"), set())]
            if kept:
                db.execute(
                    "INSERT OR IGNORE INTO facts (key, value_json) VALUES (?, ?)",
                    (import_fact_key(service, revision), json.dumps({"secretRefs": kept})),
                )


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "services, clusters, events, small key/value facts (the ingress process, ...)",
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
    ),
    Migration(
        2,
        'an audit row per Serve config PUT, so "never submitted twice" can be checked',
        """
        CREATE TABLE submissions (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            cluster TEXT NOT NULL,
            config_hash TEXT NOT NULL,
            time REAL NOT NULL
        );
        """,
    ),
    Migration(
        3,
        "the hash of the code package a spec points at: a code-only change is a new generation",
        """
        ALTER TABLE services ADD COLUMN package_hash TEXT;
        ALTER TABLE clusters ADD COLUMN package_hash TEXT;
        """,
    ),
    Migration(
        4,
        "the document of each PUT (to recognise it in Ray's answers, and to restore it), and per cluster "
        "the last config seen running well",
        """
        ALTER TABLE submissions ADD COLUMN document_json TEXT;
        ALTER TABLE clusters ADD COLUMN good_config_hash TEXT;
        """,
    ),
    Migration(
        5,
        "progressive delivery: a canary's progress (controller-owned) and the commands an operator gave it "
        "(API-owned counters, so that a command given mid-tick is never lost); one row per generation of a "
        "service, for history and undo",
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
    ),
    Migration(
        6,
        "host pools (issue 10): the machines multi-host clusters run on, as applied",
        """
        CREATE TABLE host_pools (
            name TEXT PRIMARY KEY,
            spec_json TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        );
        """,
    ),
    Migration(
        7,
        "clusters on a host pool: the pool, and each node's host, ports and process",
        """
        ALTER TABLE clusters ADD COLUMN pool TEXT;
        ALTER TABLE clusters ADD COLUMN nodes_json TEXT NOT NULL DEFAULT '[]';
        """,
    ),
    Migration(
        8,
        "bounded growth (issue 19): submissions indexed by (cluster, config hash), those of removed clusters "
        "gone and at most 50 per cluster beyond the configs it names; the facts of deleted services gone, and "
        "of their events the newest 100 in all; each service's import fact kept for its current revision too, "
        "and its secret references for every stored revision whose env holds their names",
        """
        CREATE INDEX submissions_by_cluster ON submissions(cluster, config_hash, id);
        DELETE FROM submissions WHERE cluster NOT IN (SELECT name FROM clusters);
        DELETE FROM submissions WHERE id IN (
            SELECT id FROM (
                SELECT id, cluster, config_hash,
                       ROW_NUMBER() OVER (PARTITION BY cluster ORDER BY id DESC) AS newest
                FROM submissions
            ) AS ranked
            WHERE newest > 50 AND NOT EXISTS (
                SELECT 1 FROM clusters WHERE clusters.name = ranked.cluster AND ranked.config_hash IN
                    (clusters.good_config_hash, clusters.applied_config_hash, clusters.submitted_config_hash)
            )
        );
        DELETE FROM facts WHERE substr(key, 1, 11) = 'applied-at/'
            AND substr(key, 12) NOT IN (SELECT name FROM services);
        DELETE FROM facts WHERE substr(key, 1, 7) = 'import:' AND NOT EXISTS (
            SELECT 1 FROM services WHERE facts.key = 'import:' || services.name
                OR substr(facts.key, 1, length(services.name) + 8) = 'import:' || services.name || '@'
        );
        INSERT OR IGNORE INTO facts (key, value_json)
            SELECT 'import:' || services.name || '@' || services.generation, facts.value_json
            FROM services JOIN facts ON facts.key = 'import:' || services.name;
        DELETE FROM events WHERE service NOT IN (SELECT name FROM services) AND id NOT IN (
            SELECT id FROM events WHERE service NOT IN (SELECT name FROM services) ORDER BY id DESC LIMIT 100
        )
        """,
        then=_backfill_revision_secret_refs,
    ),
    Migration(
        9,
        "standby clusters (issue 20): when a warm standby began taking over from a dead active; a service's "
        "standby builds tried since the last ready one, and the time the next may start",
        """
        ALTER TABLE clusters ADD COLUMN takeover_started_at REAL;
        ALTER TABLE services ADD COLUMN standby_failures INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE services ADD COLUMN standby_retry_at REAL;
        """,
    ),
    Migration(
        10,
        "heads that move host (issue 20): the nodes a move left on a silent host, stopped once it answers",
        """
        ALTER TABLE clusters ADD COLUMN left_behind_json TEXT NOT NULL DEFAULT '[]';
        """,
    ),
)
SCHEMA_VERSION = MIGRATIONS[-1].version


def schema_version(db: sqlite3.Connection) -> int:
    return int(db.execute("PRAGMA user_version").fetchone()[0])


def apply_migration(db: sqlite3.Connection, migration: Migration) -> None:
    """Run one migration and record its version, inside the caller's transaction."""
    # executescript() would COMMIT first; run the statements one by one instead.
    for statement in migration.script.split(";"):
        if statement.strip():
            db.execute(statement)
    if migration.then is not None:
        migration.then(db)
    db.execute(f"PRAGMA user_version = {migration.version}")
