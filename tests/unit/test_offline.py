"""`servekeeper down` without a daemon stops what the state dir owns through the same providers
as the daemon: a cluster on a host pool is stopped on its hosts, not orphaned there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from servekeeper import offline
from servekeeper.model.hostpool import parse_host_pool
from servekeeper.providers.pool import PoolProvider
from servekeeper.store.store import Store
from tests.unit.ssh_fakes import FakeFleet, pool_document
from tests.unit.test_pool_clusters import draft, pool_spec


async def test_an_offline_down_stops_a_pool_cluster_on_its_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(tmp_path / "store.db")
    store.apply_host_pool("fleet", parse_host_pool(pool_document(("a", 4), ("b", 4))).to_json(), 1.0)
    fleet = FakeFleet()
    pools = PoolProvider(store, tmp_path, ssh_nodes=fleet)
    config = pool_spec(workers=1, cpus=4).spec.rayClusterConfig
    cluster = await pools.create(draft("c", config), config, store)

    def record(**changes: Any) -> None:
        store.update_cluster("c", **changes)

    await pools.start_nodes(cluster, config, record)
    await pools.close()
    store.close()
    assert sorted(fleet.running) == sorted(node.temp_dir for node in cluster.nodes)

    def fleet_pools(store: Store, state_dir: Path) -> PoolProvider:
        return PoolProvider(store, state_dir, ssh_nodes=fleet)

    monkeypatch.setattr(offline, "PoolProvider", fleet_pools)
    result = await offline.stop_everything_offline(tmp_path)
    assert (result.stopped, result.kept) == (1, [])
    assert fleet.running == {}  # both nodes stopped on their hosts
    assert not (tmp_path / "tokens" / "c.token").exists()
    store = Store(tmp_path / "store.db")
    assert store.list_clusters() == []
    store.close()


async def test_an_offline_down_keeps_a_cluster_whose_node_resists_and_stops_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(tmp_path / "store.db")
    store.apply_host_pool("fleet", parse_host_pool(pool_document(("a", 4), ("b", 4))).to_json(), 1.0)
    fleet = FakeFleet()
    pools = PoolProvider(store, tmp_path, ssh_nodes=fleet)
    config = pool_spec(workers=0, cpus=4).spec.rayClusterConfig
    resisting = await pools.create(draft("resisting", config), config, store)
    other = await pools.create(draft("other", config), config, store)
    for cluster in (resisting, other):

        def record(name: str = cluster.name, **changes: Any) -> None:
            store.update_cluster(name, **changes)

        await pools.start_nodes(cluster, config, record)
    await pools.close()
    store.close()
    fleet.leftovers[resisting.nodes[0].temp_dir] = [4242]  # survives SIGKILL on its host

    def fleet_pools(store: Store, state_dir: Path) -> PoolProvider:
        return PoolProvider(store, state_dir, ssh_nodes=fleet)

    monkeypatch.setattr(offline, "PoolProvider", fleet_pools)
    result = await offline.stop_everything_offline(tmp_path)
    assert result.stopped == 1 and len(result.kept) == 1
    assert result.kept[0].startswith("resisting: still running after the stop: ") and "4242" in result.kept[0]
    store = Store(tmp_path / "store.db")
    assert [c.name for c in store.list_clusters()] == ["resisting"]  # known, so a later `down` stops it
    store.close()
