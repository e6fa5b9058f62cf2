"""Events: what happened to each service, newest kept (EVENTS_KEPT_PER_SERVICE per service; of
services no longer there, the newest DELETED_SERVICES_EVENTS_KEPT in all, so that how the last
deletions went can still be read). Functions take the connection; writes run inside the
caller's transaction."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from servekeeper.model.records import Event
from servekeeper.store.rows import event_from_row

EVENTS_KEPT_PER_SERVICE = 500
DELETED_SERVICES_EVENTS_KEPT = 100


def add_events(db: sqlite3.Connection, events: Sequence[Event]) -> None:
    for event in events:
        db.execute(
            "INSERT INTO events (service, time, type, reason, message) VALUES (?, ?, ?, ?, ?)",
            (event.service, event.time, event.type, event.reason, event.message),
        )
    for service in {event.service for event in events}:
        db.execute(
            "DELETE FROM events WHERE service = ? AND id NOT IN "
            "(SELECT id FROM events WHERE service = ? ORDER BY id DESC LIMIT ?)",
            (service, service, EVENTS_KEPT_PER_SERVICE),
        )


def list_events(db: sqlite3.Connection, service: str | None, limit: int) -> list[Event]:
    """The last `limit` events (of `service`, or of all), oldest first."""
    if service is None:
        rows = db.execute("SELECT * FROM events ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
    else:
        rows = db.execute(
            "SELECT * FROM events WHERE service = ? ORDER BY id DESC LIMIT ?", (service, limit)
        ).fetchall()
    return [event_from_row(row) for row in reversed(rows)]


def prune_deleted_services_events(db: sqlite3.Connection) -> None:
    """Keep the newest DELETED_SERVICES_EVENTS_KEPT events of services that no longer exist."""
    db.execute(
        "DELETE FROM events WHERE service NOT IN (SELECT name FROM services) AND id NOT IN "
        "(SELECT id FROM events WHERE service NOT IN (SELECT name FROM services) ORDER BY id DESC LIMIT ?)",
        (DELETED_SERVICES_EVENTS_KEPT,),
    )
