"""Where nodes Ray's autoscaler asks for on a pool cluster go (providers/pool_launch.py), with the
pool provider placing the clusters on a real store and the SSH side faked: room counted for
every cluster (its group's need for a node that knows its group), spread away from the
cluster's own hosts, silent hosts and hosts without the Serve proxy ports left out, and what is
short named."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from servekeeper.core.placement import nodes_taking_room
from servekeeper.model.hostpool import parse_host_pool
from servekeeper.model.records import ClusterRecord
from servekeeper.providers.autoscaling import NodeRoomShort
from servekeeper.providers.pool import PoolProvider
from servekeeper.providers.pool_launch import place_launched
from servekeeper.providers.ray_start import group_args
from servekeeper.store.store import Store
from tests.unit.ssh_fakes import FakeFleet, pool_document
from tests.unit.test_pool_clusters import pool_spec, started


async def two_clusters(tmp_path: Path, store: Store, fleet: FakeFleet) -> tuple[PoolProvider, ClusterRecord]:
    """Hosts a to d of 4 CPUs and e of 2: `mine` (a 1-CPU head on a, a 1-CPU worker of group w on
    b) and another service's cluster taking all of c."""
    hosts = pool_document(("a", 4), ("b", 4), ("c", 4), ("d", 4), ("e", 2))
    store.apply_host_pool("fleet", parse_host_pool(hosts).to_json(), 1.0)
    pools = PoolProvider(store, tmp_path, ssh_nodes=fleet)
    mine = await started(pools, store, "mine", pool_spec(workers=1, cpus=1).spec.rayClusterConfig)
    other = await started(pools, store, "other", pool_spec(workers=0, cpus=4).spec.rayClusterConfig)
    assert [n.host for n in mine.nodes] == ["a", "b"] and [n.host for n in other.nodes] == ["c"]
    return pools, mine


async def launch(store: Store, fleet: FakeFleet, cluster: ClusterRecord, ids: list[int]) -> list[str]:
    record = store.get_host_pool("fleet")
    assert record is not None
    pool = record.spec()
    config = pool_spec(workers=1, cpus=1).spec.rayClusterConfig
    nodes = await place_launched(pool, fleet(pool.spec.hosts), store.list_clusters(), cluster, config, "w", ids)
    assert [(n.group, n.node_id, n.role) for n in nodes] == [("w", i, "worker") for i in ids[: len(nodes)]]
    held = {ports.node_manager for c in store.list_clusters() for ports in c.ports.node_ports}
    assert not held & {n.ports.node_manager for n in nodes}, "ports no cluster holds"
    assert all(n.temp_dir.endswith(f"/mine/id{i}") for n, i in zip(nodes, ids, strict=False))
    return [n.host for n in nodes]


async def test_nodes_go_where_there_is_room_beside_every_cluster_spread(tmp_path: Path, store: Store) -> None:
    fleet = FakeFleet()
    pools, mine = await two_clusters(tmp_path, store, fleet)
    # c is full (another cluster's); a and b run a node of mine: one per host (Serve's proxy ports)
    assert await launch(store, fleet, mine, [2, 3]) == ["d", "e"]
    assert await launch(store, fleet, mine, [2, 3, 4]) == ["d", "e"]  # as many as fit: Ray asks again for the rest
    await pools.close()


async def test_silent_hosts_and_hosts_without_the_proxy_ports_get_no_node(tmp_path: Path, store: Store) -> None:
    fleet = FakeFleet()
    pools, mine = await two_clusters(tmp_path, store, fleet)
    fleet.silent.add("d")
    assert await launch(store, fleet, mine, [2, 3]) == ["e"]
    fleet.taken_ports["e"] = {mine.ports.serve_http}
    both = rf"; d does not answer; e has the Serve proxy ports \[{mine.ports.serve_http}, "
    with pytest.raises(NodeRoomShort, match=both):
        await launch(store, fleet, mine, [2])
    fleet.silent.clear()
    assert await launch(store, fleet, mine, [2]) == ["d"]
    await pools.close()


async def test_a_node_that_knows_its_group_takes_that_groups_room(tmp_path: Path, store: Store) -> None:
    fleet = FakeFleet()
    pools, mine = await two_clusters(tmp_path, store, fleet)
    [node] = await place_launched(
        store.get_host_pool("fleet").spec(),  # type: ignore[union-attr]
        fleet(store.get_host_pool("fleet").spec().spec.hosts),  # type: ignore[union-attr]
        store.list_clusters(),
        mine,
        pool_spec(workers=1, cpus=1).spec.rayClusterConfig,
        "w",
        [2],
    )
    grown = mine.with_changes(nodes=(*mine.nodes, node))
    assert [(n.host, need.cpus) for n, need in nodes_taking_room(grown)] == [("a", 1), ("b", 1), ("d", 1)]
    # released for good: it takes no room; a node of an older row (no group) by its place
    released = grown.with_changes(nodes=(*grown.nodes[:2], replace(node, stopped=True)))
    assert len(nodes_taking_room(released)) == 2
    older = grown.with_changes(nodes=(grown.nodes[0], replace(grown.nodes[1], group=None)))
    assert [need.path for _, need in nodes_taking_room(older)][1] == "spec.rayClusterConfig.workerGroups.0"
    await pools.close()


async def test_the_pool_provider_places_and_records_a_launch_in_one_write(tmp_path: Path, store: Store) -> None:
    fleet = FakeFleet()
    pools, mine = await two_clusters(tmp_path, store, fleet)
    fixed = pool_spec(workers=1, cpus=1).spec.rayClusterConfig
    config = fixed.model_copy(update={"workerGroups": [fixed.workerGroups[0].model_copy(update={"maxReplicas": 8})]})
    # two launches at once: one placement at a time (the pool's lock), so neither takes the
    # other's room or ids
    (first, first_ids), (second, second_ids) = await asyncio.gather(
        pools.launch_nodes(mine, config, "w", 1, store), pools.launch_nodes(mine, config, "w", 1, store)
    )
    stored = store.get_cluster("mine")
    assert stored is not None and stored == second
    assert sorted(first_ids + second_ids) == [2, 3]  # above the placed nodes: head 0, worker 1
    added = [n for n in stored.nodes if n.node_id in first_ids + second_ids]
    assert sorted(n.host for n in added) == ["d", "e"] and all(n.pid is None for n in added)
    assert stored.ports.node_ports[2:] == tuple(n.ports for n in stored.nodes[2:])  # held with them
    short = r"host pool 'fleet': .*free: c 0 CPU/0 GPU.*; a runs a node of mine already \(one per host\)"
    with pytest.raises(NodeRoomShort, match=short):
        await pools.launch_nodes(stored, config, "w", 1, store)
    await pools.close()


async def test_a_pool_start_starts_launched_nodes_with_their_groups_and_skips_released_ones(
    tmp_path: Path, store: Store
) -> None:
    fleet = FakeFleet()
    hosts = pool_document(("a", 8), ("b", 8), ("c", 8), ("d", 8), ("e", 8))
    store.apply_host_pool("fleet", parse_host_pool(hosts).to_json(), 1.0)
    pools = PoolProvider(store, tmp_path, ssh_nodes=fleet)
    small = {"name": "w", "replicas": 1, "numCpus": 1}
    stored_spec = pool_spec(workers=0, cpus=1, workerGroups=[small, {"name": "big", "replicas": 1, "numCpus": 2}])
    config = stored_spec.spec.rayClusterConfig
    mine = await started(pools, store, "mine", config)
    assert [(n.group, n.node_id) for n in mine.nodes] == [(None, 0), ("w", 1), ("big", 2)]
    bounded = config.model_copy(update={"workerGroups": [config.workerGroups[0].model_copy(update={"maxReplicas": 4})]})
    mine, [launched_id] = await pools.launch_nodes(mine, bounded, "w", 1, store)
    mine, [released_id] = await pools.launch_nodes(mine, bounded, "w", 1, store)
    nodes = tuple(replace(n, stopped=True) if n.node_id == released_id else n for n in mine.nodes)
    mine = store.update_cluster("mine", nodes=nodes)

    def record(**changes: object) -> None:
        store.update_cluster("mine", nodes=changes["nodes"])

    await pools.start_nodes(mine, config, record)
    stored = store.get_cluster("mine")
    assert stored is not None
    by_id = {n.node_id: n for n in stored.nodes}
    assert by_id[launched_id].pid is not None and by_id[released_id].pid is None  # a released node is not started
    argv = fleet.argvs[by_id[launched_id].temp_dir]
    assert "--num-cpus=1" in argv, argv  # its own group's, not the last place's (big: 2)
    await pools.close()


def test_an_autoscaled_pool_nodes_start_carries_its_id_for_rays_autoscaler() -> None:
    config = pool_spec(workers=1, cpus=1).spec.rayClusterConfig
    assert group_args(config.workerGroups[0]) == ["--num-cpus=1"]
    with_id = group_args(config.workerGroups[0], 3)
    assert with_id[0] == "--num-cpus=1" and '--resources={"NODE_ID_AS_RESOURCE":4}' in with_id
