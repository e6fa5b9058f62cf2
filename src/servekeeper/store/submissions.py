"""Submissions: an audit row per Serve config PUT to a cluster, with the document sent, so that
"never submitted twice" can be checked and a config recognised in Ray's answers or restored."""

from __future__ import annotations

import json
import sqlite3
from typing import Any


def record_submission(
    db: sqlite3.Connection, cluster: str, config_hash: str, now: float, document_json: str | None
) -> None:
    db.execute(
        "INSERT INTO submissions (cluster, config_hash, time, document_json) VALUES (?, ?, ?, ?)",
        (cluster, config_hash, now, document_json),
    )


def count_submissions(db: sqlite3.Connection, cluster: str, config_hash: str) -> int:
    row = db.execute(
        "SELECT COUNT(*) FROM submissions WHERE cluster = ? AND config_hash = ?", (cluster, config_hash)
    ).fetchone()
    return int(row[0])


def submitted_document(db: sqlite3.Connection, cluster: str, config_hash: str) -> dict[str, Any] | None:
    """The Serve config document last PUT to `cluster` under `config_hash`, if any."""
    row = db.execute(
        "SELECT document_json FROM submissions WHERE cluster = ? AND config_hash = ? "
        "AND document_json IS NOT NULL ORDER BY id DESC LIMIT 1",
        (cluster, config_hash),
    ).fetchone()
    return dict(json.loads(row[0])) if row else None


def list_submissions(db: sqlite3.Connection) -> list[tuple[str, str, float]]:
    rows = db.execute("SELECT cluster, config_hash, time FROM submissions ORDER BY id").fetchall()
    return [(r["cluster"], r["config_hash"], r["time"]) for r in rows]
