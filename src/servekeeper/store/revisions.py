"""Revisions: one row per generation of a service, for its history and for undo, with how its
rollout ended. Functions take the connection; writes run inside the caller's transaction."""

from __future__ import annotations

import hashlib
import sqlite3

from servekeeper.model.records import Revision, ServiceRecord
from servekeeper.store.facts import forget_pruned_revision_facts
from servekeeper.store.rows import revision_from_row, rows_changed

PROGRESSING = "Progressing"  # a revision's outcome while it rolls out
SUPERSEDED = "Superseded"


def add_revision(db: sqlite3.Connection, service: ServiceRecord, cause: str, now: float, limit: int) -> None:
    """A new generation: the one still rolling out is superseded, the oldest beyond `limit` go."""
    db.execute(
        "UPDATE revisions SET outcome = ?, ended_by = ?, ended_at = ? WHERE service = ? AND outcome = ?",
        (SUPERSEDED, f"revision {service.generation}", now, service.name, PROGRESSING),
    )
    spec_hash = hashlib.sha256(service.spec_json.encode()).hexdigest()[:16]
    db.execute(
        "INSERT OR REPLACE INTO revisions (service, revision, spec_json, spec_hash, package_hash, created_at, "
        "cause, outcome) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (service.name, service.generation, service.spec_json, spec_hash, service.package_hash, now, cause, PROGRESSING),
    )
    db.execute("DELETE FROM revisions WHERE service = ? AND revision <= ?", (service.name, service.generation - limit))
    forget_pruned_revision_facts(db, service.name)


def list_revisions(db: sqlite3.Connection, service: str) -> list[Revision]:
    rows = db.execute("SELECT * FROM revisions WHERE service = ? ORDER BY revision", (service,)).fetchall()
    return [revision_from_row(row) for row in rows]


def get_revision(db: sqlite3.Connection, service: str, revision: int) -> Revision | None:
    row = db.execute("SELECT * FROM revisions WHERE service = ? AND revision = ?", (service, revision)).fetchone()
    return revision_from_row(row) if row else None


def end_revision(
    db: sqlite3.Connection, service: str, revision: int, outcome: str, ended_by: str, message: str, now: float
) -> bool:
    """Record how a revision's rollout ended, once: the first ending stands."""
    db.execute(
        "UPDATE revisions SET outcome = ?, ended_by = ?, message = ?, ended_at = ? "
        "WHERE service = ? AND revision = ? AND outcome = ?",
        (outcome, ended_by, message, now, service, revision, PROGRESSING),
    )
    return rows_changed(db) > 0


def forget_revisions(db: sqlite3.Connection, service: str) -> None:
    db.execute("DELETE FROM revisions WHERE service = ?", (service,))
