"""A host pool changed while a cluster is being placed on it (issue 19, item 9).

Placing a pool cluster spends seconds in SSH calls (probes, port allocation) between reading
the pool and storing the cluster's record; the pool commands only see stored clusters. A pool
deleted, or a host's address changed, in that window must not leave a record placed on a pool
that is gone (a cluster nothing can stop) or on an old address (Envoy endpoints nowhere)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from servekeeper.commands.errors import Conflict
from servekeeper.commands.hosts import HostPoolCommands
from servekeeper.model.hostpool import HostSpec
from servekeeper.model.records import NodePorts
from servekeeper.providers.base import RetryableProviderError
from servekeeper.providers.cluster_token import token_file
from servekeeper.providers.pool import PoolProvider
from servekeeper.providers.pool_placement import PoolChanged
from servekeeper.store.store import Store
from tests.unit.ssh_fakes import FakeFleet, FakeSshNodes, pool_document
from tests.unit.test_pool_clusters import draft, pool_spec

CONFIG = pool_spec(workers=1).spec.rayClusterConfig


class HeldFleet(FakeFleet):
    """Port allocation waits for `release` (set `allocating` once it waits): the window in which
    a placement has read the pool and not yet stored its cluster."""

    def __init__(self) -> None:
        super().__init__()
        self.allocating = asyncio.Event()
        self.release = asyncio.Event()

    def __call__(self, hosts: Sequence[HostSpec]) -> FakeSshNodes:
        nodes = HeldSshNodes(self, hosts)
        self.made.append(nodes)
        return nodes


class HeldSshNodes(FakeSshNodes):
    fleet: HeldFleet

    async def node_ports(self, host: str, reserved: Sequence[int] = (), extra: int = 0) -> tuple[NodePorts, list[int]]:
        self.fleet.allocating.set()
        await self.fleet.release.wait()
        return await super().node_ports(host, reserved, extra)


@pytest.fixture
def store(store: Store) -> Store:
    """The shared store fixture's, with a pool of two hosts applied through the command."""
    HostPoolCommands(store).apply(pool_document(("a", 4), ("b", 4)))
    return store


async def test_a_pool_deleted_while_a_cluster_is_placed_leaves_no_cluster_on_it(tmp_path: Path, store: Store) -> None:
    fleet = HeldFleet()
    pools = PoolProvider(store, tmp_path, ssh_nodes=fleet)
    creating = asyncio.ensure_future(pools.create(draft("c", CONFIG), CONFIG, store))
    await fleet.allocating.wait()
    assert HostPoolCommands(store).delete("fleet") == {"name": "fleet", "deleted": True}  # nothing stored uses it
    fleet.release.set()
    with pytest.raises(PoolChanged, match="host pool 'fleet' was deleted while cluster 'c' was placed"):
        await creating
    assert issubclass(PoolChanged, RetryableProviderError)  # the rollout waits, says why, and tries again
    assert store.list_clusters() == []  # no record that nothing could stop
    assert not token_file(pools.token_dir, "c").exists()
    await pools.close()


async def test_a_host_address_changed_while_a_cluster_is_placed_places_it_again(tmp_path: Path, store: Store) -> None:
    fleet = HeldFleet()
    pools = PoolProvider(store, tmp_path, ssh_nodes=fleet)
    creating = asyncio.ensure_future(pools.create(draft("c", CONFIG), CONFIG, store))
    await fleet.allocating.wait()
    moved = pool_document(("a", 4), ("b", 4))
    moved["spec"]["hosts"][0]["address"] = "10.0.0.99"
    HostPoolCommands(store).apply(moved)  # nothing stored uses host a yet
    fleet.release.set()
    with pytest.raises(PoolChanged, match="host pool 'fleet' was changed while cluster 'c' was placed"):
        await creating
    assert store.list_clusters() == []  # no endpoint on the old address
    cluster = await pools.create(draft("c", CONFIG), CONFIG, store)  # the next tick places it anew
    assert {node.host: node.address for node in cluster.nodes} == {"a": "10.0.0.99", "b": "10.0.0.12"}
    with pytest.raises(Conflict, match=r"hosts \['a'\] of pool 'fleet' run nodes of clusters \['c'\]"):
        HostPoolCommands(store).apply(pool_document(("a", 4), ("b", 4)))  # stored: refused as before
    await pools.close()


async def test_a_pool_unchanged_meanwhile_is_placed_as_always(tmp_path: Path, store: Store) -> None:
    fleet = HeldFleet()
    pools = PoolProvider(store, tmp_path, ssh_nodes=fleet)
    creating = asyncio.ensure_future(pools.create(draft("c", CONFIG), CONFIG, store))
    await fleet.allocating.wait()
    HostPoolCommands(store).apply(pool_document(("a", 4), ("b", 4)))  # the same spec again: no change
    fleet.release.set()
    cluster = await creating
    assert store.get_cluster("c") == cluster and cluster.pool == "fleet"
    assert token_file(pools.token_dir, "c").exists()
    await pools.close()
