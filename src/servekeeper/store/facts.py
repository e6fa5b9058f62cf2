"""Facts: small values the daemon keeps by key, as JSON (the ingress process, ...).

A service's facts are named after it (`service_fact_keys`) so that they go with its record:
a deleted service leaves none behind, and a revision's facts go when the revision is pruned."""

from __future__ import annotations

import json
import sqlite3
from typing import Any


def import_fact_key(service: str, revision: int | None = None) -> str:
    """How a service's spec was imported (KubeRay notes, secret references): of the current
    generation, or of one revision (kept with it, so that `undo` restores its secret references)."""
    return f"import:{service}" if revision is None else f"import:{service}@{revision}"


def applied_at_fact_key(service: str) -> str:
    """When the service's latest generation was applied: {"generation": g, "time": t}."""
    return f"applied-at/{service}"


def get_fact(db: sqlite3.Connection, key: str) -> Any:
    row = db.execute("SELECT value_json FROM facts WHERE key = ?", (key,)).fetchone()
    return json.loads(row[0]) if row else None


def set_fact(db: sqlite3.Connection, key: str, value: Any) -> None:
    db.execute(
        "INSERT INTO facts (key, value_json) VALUES (?, ?) "
        "ON CONFLICT(key) DO UPDATE SET value_json = excluded.value_json",
        (key, json.dumps(value)),
    )


def forget_service_facts(db: sqlite3.Connection, service: str) -> None:
    """Every fact of a service whose record is deleted."""
    db.execute("DELETE FROM facts WHERE key IN (?, ?)", (import_fact_key(service), applied_at_fact_key(service)))
    prefix = import_fact_key(service, 0)[:-1]  # "import:{service}@", compared exactly (no LIKE wildcards)
    db.execute("DELETE FROM facts WHERE substr(key, 1, ?) = ?", (len(prefix), prefix))


def forget_pruned_revision_facts(db: sqlite3.Connection, service: str) -> None:
    """The per-revision facts of revisions no longer in the service's history."""
    prefix = import_fact_key(service, 0)[:-1]
    db.execute(
        "DELETE FROM facts WHERE substr(key, 1, ?) = ? AND CAST(substr(key, ?) AS INTEGER) NOT IN "
        "(SELECT revision FROM revisions WHERE service = ?)",
        (len(prefix), prefix, len(prefix) + 1, service),
    )
