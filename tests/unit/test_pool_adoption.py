"""A pool cluster's start after a controller was killed between a node's launch and its record
(providers/pool.py, pool_nodes.adopt_or_clear), on a real store with the SSH side faked: a worker
of a head that runs on is adopted (Ray knows it already, it asked for it), never a second node
beside it; a worker of a head this same start launches again is stopped by its tag and started
again (its raylet lost the GCS it joined); the node-spawned fault point is reached for a node
added to a running cluster only."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from servekeeper.core.hooks import Hooks
from servekeeper.model.hostpool import parse_host_pool
from servekeeper.model.records import ClusterRecord
from servekeeper.providers.pool import PoolProvider
from servekeeper.providers.ssh_nodes import NodeUnreachable
from servekeeper.store.store import Store
from tests.unit.ssh_fakes import FakeFleet, pool_document
from tests.unit.test_pool_clusters import pool_spec, started

CONFIG = pool_spec(workers=1, cpus=1).spec.rayClusterConfig


class SeenPoints(Hooks):
    def __init__(self) -> None:
        self.points: list[tuple[str, str | None]] = []

    def reached(self, point: str, cluster: ClusterRecord | None = None, service_generation: int = 0) -> None:
        self.points.append((point, cluster.name if cluster is not None else None))


async def a_running_cluster(tmp_path: Path, store: Store, fleet: FakeFleet, hooks: Hooks) -> PoolProvider:
    store.apply_host_pool("fleet", parse_host_pool(pool_document(("a", 4), ("b", 4))).to_json(), 1.0)
    pools = PoolProvider(store, tmp_path, ssh_nodes=fleet, hooks=hooks)
    await started(pools, store, "c", CONFIG)
    store.update_cluster("c", ready_at=5.0)
    return pools


def forget_pids(store: Store, *indexes: int) -> ClusterRecord:
    """The record as a controller killed before recording those nodes' launches left it."""
    cluster = store.get_cluster("c")
    assert cluster is not None
    nodes = [replace(n, pid=None, session_id=None) if i in indexes else n for i, n in enumerate(cluster.nodes)]
    store.update_cluster("c", nodes=nodes)
    return store.get_cluster("c")  # type: ignore[return-value]


async def start_again(pools: PoolProvider, store: Store, cluster: ClusterRecord) -> ClusterRecord:
    def record(**changes: Any) -> None:
        store.update_cluster("c", nodes=changes["nodes"])

    await pools.start_nodes(cluster, CONFIG, record)
    return store.get_cluster("c")  # type: ignore[return-value]


async def test_an_unrecorded_worker_of_a_running_head_is_adopted_not_started_twice(
    tmp_path: Path, store: Store
) -> None:
    fleet, hooks = FakeFleet(), SeenPoints()
    pools = await a_running_cluster(tmp_path, store, fleet, hooks)
    worker = store.get_cluster("c").nodes[1]  # type: ignore[union-attr]
    launches, stops = len([call for call in fleet.calls if call[0] == "launch"]), len(fleet.stopped)
    cluster = await start_again(pools, store, forget_pids(store, 1))
    assert cluster.nodes[1].pid == worker.pid and cluster.nodes[1].session_id == worker.pid, "adopted"
    assert len([call for call in fleet.calls if call[0] == "launch"]) == launches, "no second node"
    assert fleet.stopped[stops:] == [], "not stopped either"
    assert ("leaders", worker.temp_dir) in fleet.calls
    assert hooks.points == [], "nothing was spawned"
    await pools.close()


async def test_a_worker_of_a_head_started_again_is_stopped_by_its_tag_and_started_again(
    tmp_path: Path, store: Store
) -> None:
    fleet, hooks = FakeFleet(), SeenPoints()
    pools = await a_running_cluster(tmp_path, store, fleet, hooks)
    head, worker = store.get_cluster("c").nodes  # type: ignore[union-attr]
    stops = len(fleet.stopped)
    cluster = await start_again(pools, store, forget_pids(store, 0, 1))
    stopped = [(node.temp_dir, node.pid) for node in fleet.stopped[stops:]]
    assert stopped == [(head.temp_dir, -1), (worker.temp_dir, -1)], "both stopped by their tags"
    assert ("leaders", worker.temp_dir) not in fleet.calls and ("leaders", head.temp_dir) not in fleet.calls
    assert cluster.nodes[0].pid not in (None, head.pid) and cluster.nodes[1].pid not in (None, worker.pid)
    assert hooks.points == [("node-spawned", "c"), ("node-spawned", "c")], "nodes added to a running cluster"
    await pools.close()


async def test_a_silent_host_adopts_nothing_and_launches_nothing(tmp_path: Path, store: Store) -> None:
    fleet, hooks = FakeFleet(), SeenPoints()
    pools = await a_running_cluster(tmp_path, store, fleet, hooks)
    worker = store.get_cluster("c").nodes[1]  # type: ignore[union-attr]
    launches = len([call for call in fleet.calls if call[0] == "launch"])
    cluster = forget_pids(store, 1)
    fleet.silent.add(worker.host)
    with pytest.raises(NodeUnreachable):
        await start_again(pools, store, cluster)
    assert store.get_cluster("c") == cluster, "the record unchanged: the node may run there"
    assert len([call for call in fleet.calls if call[0] == "launch"]) == launches
    await pools.close()


async def test_a_worker_found_not_running_is_started(tmp_path: Path, store: Store) -> None:
    fleet, hooks = FakeFleet(), SeenPoints()
    pools = await a_running_cluster(tmp_path, store, fleet, hooks)
    worker = store.get_cluster("c").nodes[1]  # type: ignore[union-attr]
    del fleet.running[worker.temp_dir]  # the launch never reached the host
    cluster = await start_again(pools, store, forget_pids(store, 1))
    assert ("leaders", worker.temp_dir) in fleet.calls
    assert cluster.nodes[1].pid is not None and cluster.nodes[1].pid != worker.pid
    assert fleet.running[worker.temp_dir].pid == cluster.nodes[1].pid
    assert hooks.points == [("node-spawned", "c")]
    await pools.close()
