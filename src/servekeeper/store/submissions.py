"""Submissions: an audit row per Serve config PUT to a cluster, with the document sent, so that
"never submitted twice" can be checked and a config recognised in Ray's answers or restored.

Bounded: a cluster keeps its newest SUBMISSIONS_KEPT_PER_CLUSTER rows plus those of the configs
it still names (good, applied, submitted: what a restore or a recognition needs), and its rows
go with its record."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

SUBMISSIONS_KEPT_PER_CLUSTER = 50  # at least 10 configs at MAX_PUTS_PER_CONFIG (5) PUTs each


def record_submission(
    db: sqlite3.Connection, cluster: str, config_hash: str, now: float, document_json: str | None
) -> None:
    db.execute(
        "INSERT INTO submissions (cluster, config_hash, time, document_json) VALUES (?, ?, ?, ?)",
        (cluster, config_hash, now, document_json),
    )
    db.execute(
        "DELETE FROM submissions WHERE cluster = ? AND id NOT IN "
        "(SELECT id FROM submissions WHERE cluster = ? ORDER BY id DESC LIMIT ?) AND config_hash NOT IN "
        "(SELECT value FROM clusters, json_each(json_array(good_config_hash, applied_config_hash, "
        "submitted_config_hash)) WHERE name = ? AND value IS NOT NULL)",
        (cluster, cluster, SUBMISSIONS_KEPT_PER_CLUSTER, cluster),
    )


def forget_cluster_submissions(db: sqlite3.Connection, cluster: str) -> None:
    """A removed cluster's rows: its name is never used again (each has a random suffix)."""
    db.execute("DELETE FROM submissions WHERE cluster = ?", (cluster,))


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
