"""Issue 19 item 13: nothing grows with the number of services ever applied and deleted. A
service applied, rolled out and deleted 1,000 times, each under a new name, against the real
SQLite store and the real Controller (fakes of the provider, Serve API, data plane and clock,
as in test_controller.py): the store file, every table's row count, the metric label sets and
the controller's per-service state are the same after 1,000 as after 100."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from servekeeper.commands.apply import store_spec
from servekeeper.controller import loop as controller_module
from servekeeper.model.enums import ClusterRole
from servekeeper.model.spec import parse_spec
from servekeeper.store.schema import MIGRATIONS, SCHEMA_VERSION
from servekeeper.store.store import Store
from servekeeper.store.submissions import SUBMISSIONS_KEPT_PER_CLUSTER
from tests.unit.test_controller import World, make_spec, world
from tests.unit.test_store import cluster

__all__ = ["world"]  # the fixture, imported for pytest


def spec_json(name: str) -> str:
    document = json.loads(make_spec().to_json())
    document["metadata"]["name"] = name
    return parse_spec(document).to_json()


async def apply_roll_out_and_delete(world: World, name: str) -> None:
    imported = {"source": "ray.io/v1 RayService", "notes": [], "secretRefs": []}
    store_spec(world.store, name, spec_json(name), None, imported, history_limit=10)
    controller = world.controller
    for _ in range(10):  # create, PUT, observe running, switch
        await controller.tick(name)
        await world.background_settled()
        world.clock.advance(1)
        if [c.role for c in world.store.list_clusters(name)] == [ClusterRole.ACTIVE]:
            break
    assert [c.role for c in world.store.list_clusters(name)] == [ClusterRole.ACTIVE], world.store.list_events(name)
    world.store.mark_deleting(name)
    # The service's loop, as `run` starts it: it ticks until the service is gone, then ends.
    task = controller._service_tasks[name] = asyncio.create_task(controller._guarded_service_loop(name))
    await asyncio.wait_for(task, 5)
    assert world.store.get_service(name) is None
    # The fakes' own memory: a stopped cluster's Ray is gone (and a later one may get its port).
    world.serve.deployed.clear()
    world.serve.status.clear()


def footprint(world: World, path: Path) -> dict[str, Any]:
    db = sqlite3.connect(path)
    try:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        tables = [row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        rows = {table: db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] for table in tables}
    finally:
        db.close()
    samples = [(s.name, tuple(sorted(s.labels.items()))) for m in world.controller.metrics.collect() for s in m.samples]
    controller = world.controller
    return {
        "rows": rows,
        "pages": path.stat().st_size // 4096,
        "metric label sets": len(set(samples)),
        "controller state": (
            len(controller._service_tasks),
            len(controller._wakeups),
            len(controller.observations),
            len(controller.observer.silent_hosts),
            len(controller.executor.shortfalls),
            len(controller.executor.background),
            len(controller.documents.cache),
        ),
    }


async def test_a_thousand_services_applied_and_deleted_leave_nothing_growing(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for constant in ("PENDING_TICK_SECONDS", "FAST_TICK_SECONDS", "STEADY_TICK_SECONDS"):
        monkeypatch.setattr(controller_module, constant, 0.0)
    world.serve.status_after_put = "RUNNING"  # Ray runs each new config at once
    path = tmp_path / "servekeeper.db"
    for number in range(100):
        await apply_roll_out_and_delete(world, f"svc-{number}")
    after_100 = footprint(world, path)
    for number in range(100, 1000):
        await apply_roll_out_and_delete(world, f"svc-{number}")
    after_1000 = footprint(world, path)
    assert after_1000 == after_100
    assert after_1000["rows"]["submissions"] == 0 and after_1000["rows"]["facts"] == 0


def test_an_old_store_with_rows_is_migrated_and_pruned(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    old = sqlite3.connect(path)
    for migration in MIGRATIONS[:7]:
        old.executescript(migration.script)
    old.execute("PRAGMA user_version = 7")
    old.execute("INSERT INTO services (name, spec_json, generation, created_at) VALUES ('live', '{}', 2, 1.0)")
    old.execute(
        "INSERT INTO clusters (name, service, generation, cluster_spec_hash, cluster_spec_json, role, ports_json, "
        "temp_dir, log_dir, created_at, good_config_hash) VALUES ('live-c', 'live', 2, 'x', '{}', 'active', '{}', "
        "'/t', '/l', 1.0, 'good')"
    )
    submissions = [("live-c", "good")] + [("live-c", f"h{i}") for i in range(60)] + [("gone-c", "h")] * 10
    old.executemany("INSERT INTO submissions (cluster, config_hash, time) VALUES (?, ?, 1.0)", submissions)
    facts = ["import:live", "applied-at/live", "import:gone", "import:gone@3", "applied-at/gone", "ingress"]
    old.executemany("INSERT INTO facts (key, value_json) VALUES (?, '{\"secretRefs\": []}')", [(k,) for k in facts])
    events = [("live", i) for i in range(5)] + [("gone", i) for i in range(150)]
    old.executemany(
        "INSERT INTO events (service, time, type, reason, message) VALUES (?, ?, 'Normal', 'R', 'm')", events
    )
    old.commit()
    old.close()

    store = Store(path)
    assert store.schema_version == SCHEMA_VERSION
    kept = store.list_submissions()
    assert {cluster for cluster, _, _ in kept} == {"live-c"}
    assert len(kept) == SUBMISSIONS_KEPT_PER_CLUSTER + 1 and ("live-c", "good", 1.0) in kept  # its good config stays
    assert store.get_fact("import:live@2") == {"secretRefs": []}  # the current revision's secret references
    for gone in ("import:gone", "import:gone@3", "applied-at/gone"):
        assert store.get_fact(gone) is None
    assert store.get_fact("ingress") is not None and store.get_fact("applied-at/live") is not None
    assert len(store.list_events("live")) == 5 and len(store.list_events("gone", limit=500)) == 100
    db = sqlite3.connect(path)
    plan = " ".join(
        str(row)
        for row in db.execute(
            "EXPLAIN QUERY PLAN SELECT COUNT(*) FROM submissions WHERE cluster = 'c' AND config_hash = 'h'"
        )
    )
    db.close()
    assert "submissions_by_cluster" in plan
    store.close()


def test_a_cluster_keeps_its_newest_submissions_and_those_of_the_configs_it_names(tmp_path: Path) -> None:
    store = Store(tmp_path / "store.db")
    named = cluster().with_changes(good_config_hash="good")
    store.put_cluster(named)
    for name in (named.name, "unnamed"):
        store.record_submission(name, "good", 1.0, '{"applications": []}')
        for number in range(SUBMISSIONS_KEPT_PER_CLUSTER + 20):
            store.record_submission(name, f"h{number}", 2.0)
    assert store.submitted_document(named.name, "good") == {"applications": []}  # what a restore needs
    assert store.count_submissions("unnamed", "good") == 0  # no cluster names it: pruned as the oldest
    counts = Counter(name for name, _, _ in store.list_submissions())
    assert counts == {named.name: SUBMISSIONS_KEPT_PER_CLUSTER + 1, "unnamed": SUBMISSIONS_KEPT_PER_CLUSTER}
    store.remove_cluster(named.name)
    assert {name for name, _, _ in store.list_submissions()} == {"unnamed"}
    store.close()


def test_a_revisions_import_fact_goes_with_the_revision(tmp_path: Path) -> None:
    store = Store(tmp_path / "store.db")
    for number in range(1, 4):
        imported = {"source": "ray.io/v1 RayService", "notes": [], "secretRefs": [], "n": number}
        store_spec(store, "svc", json.dumps({"n": number}), None, imported, history_limit=2)
    assert [r.revision for r in store.list_revisions("svc")] == [2, 3]
    assert store.get_fact("import:svc@1") is None
    assert [store.get_fact(f"import:svc@{n}")["n"] for n in (2, 3)] == [2, 3]
    store.close()
