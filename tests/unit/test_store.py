"""The store: migrations, typed round trips, and refusing a broken file without touching it."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from servekeeper.status import (
    ClusterPorts,
    ClusterRecord,
    ClusterRole,
    Condition,
    ConditionType,
    Event,
    NodePorts,
    ServiceRecord,
)
from servekeeper.store import MIGRATIONS, SCHEMA_VERSION, Store, StoreError


def cluster(name: str = "svc-g1-abc") -> ClusterRecord:
    return ClusterRecord(
        name=name,
        service="svc",
        generation=1,
        cluster_spec_hash="h",
        cluster_spec_json="{}",
        role=ClusterRole.PENDING,
        ports=ClusterPorts(1, 2, 3, 4, 5, (NodePorts(6, 7, 8, 9, 10, 11, 12, 13),)),
        temp_dir="/tmp/sk-x",
        log_dir="/state/clusters/x",
        created_at=1.0,
    )


def test_round_trips_services_clusters_events(tmp_path: Path) -> None:
    store = Store(tmp_path / "store.db")
    service, changed = store.apply_spec("svc", '{"a": 1}', now=5.0)
    assert changed and service.generation == 1
    same, changed = store.apply_spec("svc", '{"a": 1}', now=6.0)
    assert not changed and same.generation == 1
    updated, changed = store.apply_spec("svc", '{"a": 2}', now=7.0)
    assert changed and updated.generation == 2

    condition = Condition(ConditionType.READY, True, "Ready", "ok", 3.0)
    store.put_service(updated.with_changes(conditions=(condition,), unhealthy_since=4.0))
    loaded = store.get_service("svc")
    assert loaded is not None and loaded.conditions == (condition,) and loaded.unhealthy_since == 4.0

    record = cluster().with_changes(head_pid=42, worker_pids=(43, 44))
    store.put_cluster(record)
    assert store.get_cluster(record.name) == record
    assert store.update_cluster(record.name, role=ClusterRole.ACTIVE).role == ClusterRole.ACTIVE
    store.add_events([Event("svc", 1.0, "Normal", "R", "m")])
    assert [e.reason for e in store.list_events("svc")] == ["R"]
    store.close()
    reopened = Store(tmp_path / "store.db")
    assert reopened.get_cluster(record.name) is not None
    assert reopened.get_service("svc") == ServiceRecord(**loaded.__dict__)


def test_a_store_from_an_older_schema_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    old = sqlite3.connect(path)
    old.executescript(MIGRATIONS[0])
    old.execute("PRAGMA user_version = 1")
    old.execute("INSERT INTO services (name, spec_json, generation, created_at) VALUES ('svc', '{}', 3, 1.0)")
    old.commit()
    old.close()
    store = Store(path)
    assert store.schema_version == SCHEMA_VERSION
    assert store.get_service("svc") is not None and store.get_service("svc").generation == 3  # type: ignore[union-attr]
    store.record_submission("c", "h", 1.0)
    assert store.list_submissions() == [("c", "h", 1.0)]


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")
    db.close()
    with pytest.raises(StoreError, match="newer"):
        Store(path)


def test_a_corrupt_file_is_refused_and_left_untouched(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    garbage = b"this is not a database" * 100
    path.write_bytes(garbage)
    with pytest.raises(StoreError, match="unreadable or corrupt"):
        Store(path)
    assert path.read_bytes() == garbage


def test_a_failed_transaction_leaves_nothing(tmp_path: Path) -> None:
    store = Store(tmp_path / "store.db")
    with pytest.raises(RuntimeError), store.transaction() as tx:
        tx.put_cluster(cluster())
        raise RuntimeError("crash mid-write")
    assert store.list_clusters() == []
