"""Services: the desired spec and generation (the API's) beside the status the controller
observed (the controller's). Functions take the connection; a read-modify-write must run inside
one transaction of the caller's (`Store` does that), so that it is atomic."""

from __future__ import annotations

import sqlite3
from typing import Any

from servekeeper.model.records import ServiceRecord
from servekeeper.store.events import prune_deleted_services_events
from servekeeper.store.facts import forget_service_facts
from servekeeper.store.revisions import add_revision, forget_revisions
from servekeeper.store.rows import insert_or_replace, rows_changed, service_from_row, service_row

# The fields of a service row that only the controller writes (the API owns the spec, the
# generation and the deleting flag). `persist_status` writes these and nothing else.
CONTROLLER_OWNED_FIELDS = frozenset(
    {
        "observed_generation",
        "unhealthy_since",
        "failed_generation",
        "failure_reason",
        "conditions",
        "standby_failures",
        "standby_retry_at",
    }
)


def get_service(db: sqlite3.Connection, name: str) -> ServiceRecord | None:
    row = db.execute("SELECT * FROM services WHERE name = ?", (name,)).fetchone()
    return service_from_row(row) if row else None


def list_services(db: sqlite3.Connection) -> list[ServiceRecord]:
    return [service_from_row(row) for row in db.execute("SELECT * FROM services ORDER BY name").fetchall()]


def put_service(db: sqlite3.Connection, service: ServiceRecord) -> None:
    insert_or_replace(db, "services", service_row(service))


def update_status(db: sqlite3.Connection, s: ServiceRecord) -> None:
    """Write the controller-owned fields of `s` only; the rest of the row stays as stored."""
    db.execute(
        "UPDATE services SET observed_generation = ?, unhealthy_since = ?, failed_generation = ?, "
        "failure_reason = ?, conditions_json = ?, standby_failures = ?, standby_retry_at = ? WHERE name = ?",
        (
            s.observed_generation,
            s.unhealthy_since,
            s.failed_generation,
            s.failure_reason,
            s.conditions_json(),
            s.standby_failures,
            s.standby_retry_at,
            s.name,
        ),
    )


def apply_spec(
    db: sqlite3.Connection,
    name: str,
    spec_json: str,
    now: float,
    package_hash: str | None,
    cause: str,
    history_limit: int,
) -> tuple[ServiceRecord, bool]:
    """Store a new desired spec. The generation moves only when the spec or the code package
    changed (or the service was being deleted): a code-only change is a new generation too, and
    each generation is a revision in the service's history (`cause` says what made it). Returns
    the stored record and whether anything was written."""
    current = get_service(db, name)
    if current is None:
        service = ServiceRecord(name=name, spec_json=spec_json, generation=1, created_at=now, package_hash=package_hash)
    elif current.spec_json == spec_json and current.package_hash == package_hash and not current.deleting:
        return current, False
    else:
        service = current.with_changes(
            spec_json=spec_json, generation=current.generation + 1, deleting=False, package_hash=package_hash
        )
    put_service(db, service)
    add_revision(db, service, cause, now, history_limit)
    return service, True


def mark_deleting(db: sqlite3.Connection, name: str) -> ServiceRecord | None:
    """Set the deleting flag and nothing else. None if there is no such service."""
    current = get_service(db, name)
    if current is None or current.deleting:
        return current
    db.execute("UPDATE services SET deleting = 1 WHERE name = ?", (name,))
    return current.with_changes(deleting=True)


def controller_owned(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` checked to be controller-owned (TypeError otherwise), conditions as a tuple."""
    unknown = set(fields) - CONTROLLER_OWNED_FIELDS
    if unknown:
        raise TypeError(f"persist_status writes only {sorted(CONTROLLER_OWNED_FIELDS)}, not {sorted(unknown)}")
    if "conditions" in fields:
        return {**fields, "conditions": tuple(fields["conditions"])}
    return fields


def persist_status(
    db: sqlite3.Connection, name: str, expected_generation: int, expected_deleting: bool, fields: dict[str, Any]
) -> bool:
    """Compare-and-set of controller-owned `fields` (see `controller_owned`): written only if the
    row still has `expected_generation` and `expected_deleting` (the API may have stored a new
    spec or a delete since the caller read it, and that must win) and only if a value changed.
    Returns whether it wrote."""
    current = get_service(db, name)
    if current is None or current.generation != expected_generation or current.deleting != expected_deleting:
        return False
    updated = current.with_changes(**fields)
    if updated == current:
        return False
    update_status(db, updated)
    return True


def delete_service(db: sqlite3.Connection, name: str, expected_generation: int | None) -> bool:
    """Forget a deleted service, its revisions and its facts (of its events, see `events`). With
    `expected_generation`, only if the row is still that generation and marked deleting: an apply
    stored meanwhile is never lost."""
    if expected_generation is None:
        db.execute("DELETE FROM services WHERE name = ?", (name,))
    else:
        db.execute(
            "DELETE FROM services WHERE name = ? AND generation = ? AND deleting = 1", (name, expected_generation)
        )
    deleted = rows_changed(db) > 0
    if deleted:
        forget_revisions(db, name)
        forget_service_facts(db, name)
        prune_deleted_services_events(db)
    return deleted
