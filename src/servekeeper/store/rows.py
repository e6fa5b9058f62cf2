"""Rows <-> records: how each record is laid out in its table, and read back.

Rows hold plain values and JSON, never pickles. A `*_row` function gives a record's whole row as
{column: value}; `insert_or_replace` writes such a row, so a column and its value are named
once, side by side.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping
from typing import Any

from servekeeper.model.enums import ClusterRole
from servekeeper.model.hostpool import HostPoolRecord
from servekeeper.model.records import (
    CanaryState,
    ClusterPorts,
    ClusterRecord,
    Condition,
    Event,
    NodePlacement,
    Revision,
    ServiceRecord,
)


def insert_or_replace(db: sqlite3.Connection, table: str, row: Mapping[str, Any]) -> None:
    """Write a whole row (a column left out gets its default). `table` and the columns are
    names from this package, never from a caller's input."""
    columns = ", ".join(row)
    placeholders = ", ".join("?" for _ in row)
    db.execute(f"INSERT OR REPLACE INTO {table} ({columns}) VALUES ({placeholders})", tuple(row.values()))


# -- services ----------------------------------------------------------------------------------------


def service_row(s: ServiceRecord) -> dict[str, Any]:
    return {
        "name": s.name,
        "spec_json": s.spec_json,
        "generation": s.generation,
        "observed_generation": s.observed_generation,
        "deleting": int(s.deleting),
        "unhealthy_since": s.unhealthy_since,
        "failed_generation": s.failed_generation,
        "failure_reason": s.failure_reason,
        "conditions_json": s.conditions_json(),
        "created_at": s.created_at,
        "package_hash": s.package_hash,
        "standby_failures": s.standby_failures,
        "standby_retry_at": s.standby_retry_at,
    }


def service_from_row(row: sqlite3.Row) -> ServiceRecord:
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
        standby_failures=row["standby_failures"],
        standby_retry_at=row["standby_retry_at"],
    )


def revision_from_row(row: sqlite3.Row) -> Revision:
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


# -- clusters ----------------------------------------------------------------------------------------


def cluster_row(c: ClusterRecord) -> dict[str, Any]:
    return {
        "name": c.name,
        "service": c.service,
        "generation": c.generation,
        "cluster_spec_hash": c.cluster_spec_hash,
        "cluster_spec_json": c.cluster_spec_json,
        "role": c.role.value,
        "ports_json": json.dumps(c.ports.to_json()),
        "temp_dir": c.temp_dir,
        "log_dir": c.log_dir,
        "created_at": c.created_at,
        "head_pid": c.head_pid,
        "worker_pids_json": json.dumps(list(c.worker_pids)),
        "submitted_config_hash": c.submitted_config_hash,
        "applied_config_hash": c.applied_config_hash,
        "config_submitted_at": c.config_submitted_at,
        "ready_at": c.ready_at,
        "drain_started_at": c.drain_started_at,
        "failure_reason": c.failure_reason,
        "package_hash": c.package_hash,
        "good_config_hash": c.good_config_hash,
        "canary_json": c.canary.to_json() if c.canary is not None else None,
        "promote_requests": c.promote_requests,
        "promote_full": int(c.promote_full),
        "abort_requested": int(c.abort_requested),
        "target_capacity": c.target_capacity,
        "pool": c.pool,
        "nodes_json": json.dumps([node.to_json() for node in c.nodes]),
        "takeover_started_at": c.takeover_started_at,
        "left_behind_json": json.dumps([node.to_json() for node in c.left_behind]),
    }


def cluster_from_row(row: sqlite3.Row) -> ClusterRecord:
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
        takeover_started_at=row["takeover_started_at"],
        left_behind=tuple(NodePlacement.from_json(node) for node in json.loads(row["left_behind_json"])),
    )


# -- events and host pools ---------------------------------------------------------------------------


def event_from_row(row: sqlite3.Row) -> Event:
    return Event(
        service=row["service"], time=row["time"], type=row["type"], reason=row["reason"], message=row["message"]
    )


def host_pool_row(pool: HostPoolRecord) -> dict[str, Any]:
    return {
        "name": pool.name,
        "spec_json": pool.spec_json,
        "created_at": pool.created_at,
        "updated_at": pool.updated_at,
    }


def host_pool_from_row(row: sqlite3.Row) -> HostPoolRecord:
    return HostPoolRecord(
        name=row["name"], spec_json=row["spec_json"], created_at=row["created_at"], updated_at=row["updated_at"]
    )


def rows_changed(db: sqlite3.Connection) -> int:
    """Rows changed by the connection's last statement."""
    return int(db.execute("SELECT changes()").fetchone()[0])
