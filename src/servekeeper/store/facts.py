"""Facts: small values the daemon keeps by key, as JSON (the ingress process, ...)."""

from __future__ import annotations

import json
import sqlite3
from typing import Any


def get_fact(db: sqlite3.Connection, key: str) -> Any:
    row = db.execute("SELECT value_json FROM facts WHERE key = ?", (key,)).fetchone()
    return json.loads(row[0]) if row else None


def set_fact(db: sqlite3.Connection, key: str, value: Any) -> None:
    db.execute(
        "INSERT INTO facts (key, value_json) VALUES (?, ?) "
        "ON CONFLICT(key) DO UPDATE SET value_json = excluded.value_json",
        (key, json.dumps(value)),
    )
