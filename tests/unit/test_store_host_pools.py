"""Host pools in the store: applied, listed, unchanged specs not rewritten, deleted; an older
store gains the table by migration 6 and keeps its services."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from servekeeper.model.hostpool import parse_host_pool
from servekeeper.store.schema import MIGRATIONS, SCHEMA_VERSION
from servekeeper.store.store import Store
from tests.unit.test_hostpool import VALID


def test_apply_get_list_delete(tmp_path: Path) -> None:
    store = Store(tmp_path / "store.db")
    spec_json = parse_host_pool(VALID).to_json()
    record, changed = store.apply_host_pool("fleet", spec_json, now=10.0)
    assert changed and record.created_at == record.updated_at == 10.0
    assert store.get_host_pool("fleet") == record
    assert record.spec().spec.hosts[0].name == "gpu-a"

    same, changed = store.apply_host_pool("fleet", spec_json, now=20.0)
    assert not changed and same == record  # nothing written, updated_at kept

    other = parse_host_pool({**VALID, "spec": {"hosts": VALID["spec"]["hosts"][:1]}}).to_json()
    updated, changed = store.apply_host_pool("fleet", other, now=30.0)
    assert changed and updated.created_at == 10.0 and updated.updated_at == 30.0
    store.apply_host_pool("another", spec_json, now=40.0)
    assert [pool.name for pool in store.list_host_pools()] == ["another", "fleet"]

    assert store.delete_host_pool("fleet") is True
    assert store.delete_host_pool("fleet") is False
    assert store.get_host_pool("fleet") is None
    store.close()
    assert Store(tmp_path / "store.db").get_host_pool("another") is not None  # persisted


def test_a_store_from_before_host_pools_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    old = sqlite3.connect(path)
    for migration in MIGRATIONS[:5]:
        old.executescript(migration.script)
    old.execute("PRAGMA user_version = 5")
    old.execute("INSERT INTO services (name, spec_json, generation, created_at) VALUES ('svc', '{}', 2, 1.0)")
    old.commit()
    old.close()
    store = Store(path)
    assert store.schema_version == SCHEMA_VERSION >= 6
    assert store.list_host_pools() == []
    service = store.get_service("svc")
    assert service is not None and service.generation == 2
