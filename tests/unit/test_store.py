"""The store: migrations, typed round trips, refusing a broken file without touching it, the
compare-and-set writes, and use from many threads at once."""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from servekeeper.model.enums import ClusterRole, ConditionType
from servekeeper.model.records import ClusterPorts, ClusterRecord, Condition, Event, NodePorts, ServiceRecord
from servekeeper.store.schema import MIGRATIONS, SCHEMA_VERSION
from servekeeper.store.store import Store, StoreError


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

    record = cluster().with_changes(head_pid=42, worker_pids=(43, 44), package_hash="pkg-1")
    store.put_cluster(record)
    assert store.get_cluster(record.name) == record
    assert store.update_cluster(record.name, role=ClusterRole.ACTIVE).role == ClusterRole.ACTIVE
    store.add_events([Event("svc", 1.0, "Normal", "R", "m")])
    assert [e.reason for e in store.list_events("svc")] == ["R"]
    store.close()
    reopened = Store(tmp_path / "store.db")
    assert reopened.get_cluster(record.name) is not None
    assert reopened.get_service("svc") == ServiceRecord(**loaded.__dict__)


def test_the_migrations_are_one_list_numbered_in_order() -> None:
    assert [migration.version for migration in MIGRATIONS] == list(range(1, len(MIGRATIONS) + 1))
    assert SCHEMA_VERSION == MIGRATIONS[-1].version


def test_a_store_from_an_older_schema_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    old = sqlite3.connect(path)
    old.executescript(MIGRATIONS[0].script)
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


def test_a_schema_2_store_gets_the_package_hash_columns(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    old = sqlite3.connect(path)
    old.executescript(MIGRATIONS[0].script)
    old.executescript(MIGRATIONS[1].script)
    old.execute("PRAGMA user_version = 2")
    old.execute("INSERT INTO services (name, spec_json, generation, created_at) VALUES ('svc', '{}', 3, 1.0)")
    old.commit()
    old.close()
    store = Store(path)
    assert store.schema_version == SCHEMA_VERSION
    before = store.get_service("svc")
    assert before is not None and before.generation == 3 and before.package_hash is None
    same, changed = store.apply_spec("svc", "{}", now=2.0)
    assert not changed and same == before
    coded, changed = store.apply_spec("svc", "{}", now=2.0, package_hash="pkg-1")
    assert changed and coded.generation == 4 and store.get_service("svc") == coded
    store.put_cluster(cluster().with_changes(package_hash="pkg-1"))
    assert store.get_cluster(cluster().name).package_hash == "pkg-1"  # type: ignore[union-attr]
    store.update_cluster(cluster().name, good_config_hash="good-1")
    assert store.get_cluster(cluster().name).good_config_hash == "good-1"  # type: ignore[union-attr]
    store.close()
    assert Store(path).schema_version == SCHEMA_VERSION  # a second open migrates nothing


def test_submitted_documents_are_kept_for_recognition_and_restore(tmp_path: Path) -> None:
    store = Store(tmp_path / "store.db")
    assert store.submitted_document("c1", "h1") is None
    store.record_submission("c1", "h1", 1.0, json.dumps({"applications": [{"name": "a"}]}))
    store.record_submission("c1", "h1", 2.0, json.dumps({"applications": [{"name": "b"}]}))
    store.record_submission("c2", "h1", 3.0)  # an audit row without a document (schema 2 and 3)
    assert store.submitted_document("c1", "h1") == {"applications": [{"name": "b"}]}
    assert store.submitted_document("c2", "h1") is None
    assert [row[:2] for row in store.list_submissions()] == [("c1", "h1"), ("c1", "h1"), ("c2", "h1")]


@pytest.mark.parametrize(
    ("spec_json", "package_hash", "bumps"),
    [
        pytest.param('{"a": 1}', "pkg-1", False, id="same-spec-same-code"),
        pytest.param('{"a": 2}', "pkg-1", True, id="spec-changed"),
        pytest.param('{"a": 1}', "pkg-2", True, id="code-only-change"),
        pytest.param('{"a": 1}', None, True, id="package-dropped"),
    ],
)
def test_apply_spec_moves_the_generation_when_the_spec_or_the_code_changed(
    tmp_path: Path, spec_json: str, package_hash: str | None, bumps: bool
) -> None:
    store = Store(tmp_path / "store.db")
    store.apply_spec("svc", '{"a": 1}', now=1.0, package_hash="pkg-1")
    service, changed = store.apply_spec("svc", spec_json, now=2.0, package_hash=package_hash)
    assert changed is bumps
    assert service.generation == (2 if bumps else 1)
    assert store.get_service("svc") == service
    assert service.package_hash == package_hash


def test_mark_deleting_sets_only_the_flag_and_a_new_apply_undoes_it(tmp_path: Path) -> None:
    store = Store(tmp_path / "store.db")
    assert store.mark_deleting("nope") is None
    service, _ = store.apply_spec("svc", '{"a": 1}', now=1.0, package_hash="pkg-1")
    store.persist_status("svc", 1, False, observed_generation=1, failure_reason="x")
    deleting = store.mark_deleting("svc")
    stored = store.get_service("svc")
    assert deleting is not None and deleting.deleting and deleting == stored
    assert stored.observed_generation == 1 and stored.failure_reason == "x" and stored.package_hash == "pkg-1"
    assert store.mark_deleting("svc") == stored  # idempotent
    revived, changed = store.apply_spec("svc", '{"a": 1}', now=2.0, package_hash="pkg-1")
    assert changed and revived.generation == 2 and not revived.deleting


CONDITION = Condition(ConditionType.READY, True, "Ready", "ok", 3.0)


@pytest.mark.parametrize(
    ("change_first", "expected_generation", "expected_deleting", "fields", "writes"),
    [
        pytest.param(None, 1, False, {"observed_generation": 1, "conditions": (CONDITION,)}, True, id="writes"),
        pytest.param(None, 1, False, {"observed_generation": 0}, False, id="nothing-changed"),
        pytest.param("apply", 1, False, {"observed_generation": 1}, False, id="a-new-spec-arrived"),
        pytest.param("delete", 1, False, {"observed_generation": 1}, False, id="a-delete-arrived"),
        pytest.param("delete", 1, True, {"observed_generation": 1}, True, id="already-deleting"),
        pytest.param("remove", 1, False, {"observed_generation": 1}, False, id="row-gone"),
    ],
)
def test_persist_status_is_a_compare_and_set(
    tmp_path: Path,
    change_first: str | None,
    expected_generation: int,
    expected_deleting: bool,
    fields: dict[str, Any],
    writes: bool,
) -> None:
    store = Store(tmp_path / "store.db")
    store.apply_spec("svc", '{"a": 1}', now=1.0, package_hash="pkg-1")
    if change_first == "apply":
        store.apply_spec("svc", '{"a": 2}', now=2.0)
    elif change_first == "delete":
        store.mark_deleting("svc")
    elif change_first == "remove":
        store.delete_service_row("svc")
    before = store.get_service("svc")
    assert store.persist_status("svc", expected_generation, expected_deleting, **fields) is writes
    after = store.get_service("svc")
    if writes:
        assert before is not None
        assert after == before.with_changes(**fields)  # the API-owned fields are as they were
    else:
        assert after == before


def test_persist_status_refuses_fields_the_controller_does_not_own(tmp_path: Path) -> None:
    store = Store(tmp_path / "store.db")
    store.apply_spec("svc", "{}", now=1.0)
    with pytest.raises(TypeError, match="deleting"):
        store.persist_status("svc", 1, False, deleting=False)


def test_a_nested_transaction_is_a_savepoint(tmp_path: Path) -> None:
    store = Store(tmp_path / "store.db")
    with store.transaction() as tx:
        tx.put_cluster(cluster("kept"))
        with pytest.raises(RuntimeError), store.transaction() as inner:
            inner.put_cluster(cluster("rolled-back"))
            raise RuntimeError("inner failure")
        store.put_service(ServiceRecord(name="svc", spec_json="{}", generation=1))  # a nested write
    assert [c.name for c in store.list_clusters()] == ["kept"]
    assert store.get_service("svc") is not None


def run_threads(count: int, work: Callable[[int], None]) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(count)

    def run(index: int) -> None:
        try:
            start.wait()
            work(index)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_many_threads_write_at_once_and_no_update_is_lost(tmp_path: Path) -> None:
    store = Store(tmp_path / "store.db")
    store.put_cluster(cluster("counter").with_changes(head_pid=0))
    threads, rounds = 8, 40

    def work(index: int) -> None:
        for n in range(rounds):
            # Every call has a new spec, so every call must move the generation exactly once.
            store.apply_spec("shared", f'{{"thread": {index}, "n": {n}}}', now=float(n))
            store.apply_spec(f"own-{index}", f'{{"n": {n}}}', now=float(n))
            with store.transaction() as tx:  # a read-modify-write increment
                counter = tx.get_cluster("counter")
                assert counter is not None and counter.head_pid is not None
                tx.put_cluster(counter.with_changes(head_pid=counter.head_pid + 1))
            store.add_events([Event(f"own-{index}", float(n), "Normal", "Tick", str(n))])
            shared = store.get_service("shared")
            assert shared is not None
            store.persist_status("shared", shared.generation, False, observed_generation=shared.generation)

    run_threads(threads, work)
    shared = store.get_service("shared")
    assert shared is not None and shared.generation == threads * rounds
    assert all(store.get_service(f"own-{i}").generation == rounds for i in range(threads))  # type: ignore[union-attr]
    assert store.get_cluster("counter").head_pid == threads * rounds  # type: ignore[union-attr]
    assert len(store.list_events(limit=10_000)) == threads * rounds
    db = sqlite3.connect(tmp_path / "store.db")
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()


def test_a_reader_is_not_blocked_by_another_threads_open_write(tmp_path: Path) -> None:
    store = Store(tmp_path / "store.db")
    store.apply_spec("svc", '{"a": 1}', now=1.0)
    written, release = threading.Event(), threading.Event()

    def writer() -> None:
        with store.transaction() as tx:
            current = tx.get_service("svc")
            assert current is not None
            tx.put_service(current.with_changes(spec_json='{"a": 2}'))
            written.set()
            release.wait(timeout=10)

    thread = threading.Thread(target=writer)
    thread.start()
    assert written.wait(timeout=10)
    assert store.get_service("svc").spec_json == '{"a": 1}'  # type: ignore[union-attr]  # uncommitted: not seen
    release.set()
    thread.join(timeout=10)
    assert store.get_service("svc").spec_json == '{"a": 2}'  # type: ignore[union-attr]


def test_close_closes_the_connection_of_every_thread(tmp_path: Path) -> None:
    store = Store(tmp_path / "store.db")
    run_threads(4, lambda index: store.apply_spec(f"svc-{index}", "{}", now=1.0))
    connections = list(store._connections.values())
    assert connections  # finished threads' connections are closed as new ones open
    store.close()
    for connection in connections:
        with pytest.raises(sqlite3.ProgrammingError):
            connection.execute("SELECT 1")
    with pytest.raises(StoreError, match="closed"):
        store.list_services()
    store.close()  # twice is fine


def test_forgetting_a_service_is_a_compare_and_set(tmp_path: Path) -> None:
    store = Store(tmp_path / "store.db")
    store.apply_spec("svc", "{}", now=1.0)
    store.mark_deleting("svc")
    store.apply_spec("svc", '{"v": 2}', now=2.0)  # applied again before the controller forgot it
    assert not store.delete_service_row("svc", expected_generation=1)
    assert store.get_service("svc") is not None
    store.mark_deleting("svc")
    assert store.delete_service_row("svc", expected_generation=2)
    assert store.get_service("svc") is None


def test_submissions_are_counted_per_cluster_and_config(tmp_path: Path) -> None:
    store = Store(tmp_path / "store.db")
    for cluster, config in [("c1", "h1"), ("c1", "h1"), ("c1", "h2"), ("c2", "h1")]:
        store.record_submission(cluster, config, 1.0)
    assert store.count_submissions("c1", "h1") == 2
    assert store.count_submissions("c2", "h2") == 0


def test_a_new_store_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    store = Store(tmp_path / "store.db")
    store.apply_spec("svc", '{"env": "a secret"}', now=1.0)
    for path in tmp_path.iterdir():
        assert path.stat().st_mode & 0o077 == 0, f"{path.name} is readable by others"
