"""Re-applying an unchanged pool.yaml after an upgrade: a host's workDir the document does not
write keeps the stored one. Pools stored before the per-user default saved `/tmp/servekeeper`
explicitly; filling in the new default instead would change every host in use (409)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from servekeeper.commands.hosts import HostPoolCommands
from servekeeper.model.hostpool import default_work_dir, parse_host_pool
from servekeeper.providers.pool import PoolProvider
from servekeeper.store.store import Store
from tests.unit.ssh_fakes import FakeFleet, pool_document
from tests.unit.test_pool_clusters import draft, pool_spec

LEGACY_WORK_DIR = "/tmp/servekeeper"  # the default before it was per user, stored explicitly


def with_work_dirs(document: dict[str, Any], work_dir: str) -> dict[str, Any]:
    document = copy.deepcopy(document)
    for host in document["spec"]["hosts"]:
        host["workDir"] = work_dir
    return document


def stored_work_dirs(store: Store) -> dict[str, str]:
    record = store.get_host_pool("fleet")
    assert record is not None
    return {host.name: host.workDir for host in record.spec().spec.hosts}


async def store_legacy_pool_with_a_cluster(store: Store, tmp_path: Path) -> None:
    legacy = parse_host_pool(with_work_dirs(pool_document(("a", 4), ("b", 4)), LEGACY_WORK_DIR))
    store.apply_host_pool("fleet", legacy.to_json(), 1.0)
    pools = PoolProvider(store, tmp_path, ssh_nodes=FakeFleet())
    config = pool_spec(workers=1, cpus=4).spec.rayClusterConfig
    await pools.create(draft("c", config), config, store)  # a node on each host
    await pools.close()


async def test_reapplying_a_pool_without_work_dir_keeps_the_stored_one_on_hosts_in_use(
    store: Store, tmp_path: Path
) -> None:
    await store_legacy_pool_with_a_cluster(store, tmp_path)
    answer = HostPoolCommands(store).apply(pool_document(("a", 4), ("b", 4)))  # the same pool.yaml
    assert answer["changed"] is False
    assert stored_work_dirs(store) == {"a": LEGACY_WORK_DIR, "b": LEGACY_WORK_DIR}


async def test_only_a_work_dir_written_in_the_document_changes_it(store: Store, tmp_path: Path) -> None:
    legacy = parse_host_pool(with_work_dirs(pool_document(("a", 4), ("b", 4)), LEGACY_WORK_DIR))
    store.apply_host_pool("fleet", legacy.to_json(), 1.0)  # no cluster: hosts may change
    document = pool_document(("a", 4), ("b", 4), ("c", 4))
    document["spec"]["hosts"][1]["workDir"] = "/home/ray/.servekeeper"
    HostPoolCommands(store).apply(document)
    user = document["spec"]["hosts"][2]["ssh"]["user"]
    assert stored_work_dirs(store) == {
        "a": LEGACY_WORK_DIR,  # omitted: kept
        "b": "/home/ray/.servekeeper",  # written: changed
        "c": default_work_dir(user),  # new host: the per-user default
    }


def test_a_host_whose_ssh_user_changes_gets_the_new_users_default(store: Store) -> None:
    HostPoolCommands(store).apply(pool_document(("a", 4)))
    document = pool_document(("a", 4))
    document["spec"]["hosts"][0]["ssh"]["user"] = "other"
    HostPoolCommands(store).apply(document)
    # Another user's work dir would be refused on the host (not ours): not kept.
    assert stored_work_dirs(store) == {"a": default_work_dir("other")}
