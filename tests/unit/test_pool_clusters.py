"""Clusters on a host pool, tick by tick: the real `Controller` and `PoolClusters` on a real
SQLite store, the SSH side faked (tests/unit/ssh_fakes.py). What happens when a host refuses,
when a delete comes during a launch, and what a partly stopped cluster still takes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from servekeeper.controller import Controller
from servekeeper.hostpool import parse_host_pool
from servekeeper.pool_clusters import PoolClusters
from servekeeper.ssh import CommandFailed, HostKeyRefused
from servekeeper.status import ClusterRole
from servekeeper.store import Store
from tests.unit.fakes import FakeClock, FakeDataPlane, FakeProvider, FakeServe
from tests.unit.ssh_fakes import FakeFleet, pool_document
from tests.unit.test_controller import NAME, World, make_spec


class PoolWorld(World):
    fleet: FakeFleet
    pools: PoolClusters


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[PoolWorld]:
    store = Store(tmp_path / "servekeeper.db")
    store.apply_host_pool("fleet", parse_host_pool(pool_document(("a", 4), ("b", 4))).to_json(), 1.0)
    session = aiohttp.ClientSession()
    provider, serve, dataplane, clock = FakeProvider(), FakeServe(), FakeDataPlane(), FakeClock()
    fleet = FakeFleet()
    pools = PoolClusters(store, tmp_path, ssh_nodes=fleet)
    controller = Controller(
        store,
        provider,
        dataplane,
        session,
        tmp_path,
        clock=clock,
        serve=serve,  # type: ignore[arg-type]
        pools=pools,
    )
    world = PoolWorld(store, provider, serve, dataplane, clock, controller)
    world.fleet, world.pools = fleet, pools
    try:
        yield world
    finally:
        await fleet.settle()
        await controller.shutdown(stop_clusters=False)
        await session.close()
        store.close()
        leaked = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
        assert not leaked, f"tasks left running: {leaked}"


def pool_spec(workers: int = 1, cpus: float = 2, **cluster: Any) -> Any:
    shape = {"hostPool": "fleet", "head": {"numCpus": cpus}, **cluster}
    if workers:
        shape["workerGroups"] = [{"name": "w", "replicas": workers, "numCpus": cpus}]
    return make_spec(rayClusterConfig=shape)


# -- a host that refuses ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "refusal",
    [
        pytest.param(HostKeyRefused("b (10.0.0.12:22)", "its host key is not the one in /etc/sk/known"), id="host-key"),
        pytest.param(
            CommandFailed("b (10.0.0.12:22)", ["/opt/nope/python", "-c", "0"], 127, "No such file or directory"),
            id="wrong-python",
        ),
    ],
)
async def test_a_host_refusing_for_good_fails_the_rollout_naming_the_host(world: PoolWorld, refusal: Exception) -> None:
    world.fleet.refuse["b"] = refusal  # type: ignore[assignment]
    world.apply(pool_spec(workers=1))
    await world.tick()
    [cluster] = world.clusters()
    assert cluster.failure_reason == f"StartFailed: {refusal}" and cluster.nodes == ()
    assert "InsufficientCapacity" not in world.reasons()

    world.clock.advance(1)
    await world.tick()
    service = world.service()
    assert service.failed_generation == 1 and service.failure_reason == f"StartFailed: {refusal}"
    assert "host b (10.0.0.12:22)" in (service.failure_reason or "")
    failed = [e for e in world.events() if e.reason == "RolloutFailed"]
    assert failed and "host b (10.0.0.12:22)" in failed[-1].message
    await world.background_settled()
    assert world.clusters() == []  # deleted: nothing ran, nothing to stop
    assert not any(call[0] == "launch" for call in world.fleet.calls)


async def test_a_silent_host_is_left_out_of_placement_and_the_rollout_goes_on(world: PoolWorld) -> None:
    world.fleet.silent.add("b")
    world.apply(pool_spec(workers=1))
    await world.tick()
    [cluster] = world.clusters(ClusterRole.PENDING)
    assert cluster.failure_reason is None
    assert [node.host for node in cluster.nodes] == ["a", "a"]  # both on the host that answers


async def test_a_silent_host_needed_for_room_makes_the_rollout_wait(world: PoolWorld) -> None:
    world.fleet.silent.add("b")
    world.apply(pool_spec(workers=1, cpus=3))  # 3 + 3 CPUs: one node per host
    await world.tick()
    assert world.clusters() == []
    [event] = [e for e in world.events() if e.reason == "InsufficientCapacity"]
    assert "unreachable: ['b']" in event.message
    assert world.service().failed_generation is None


# -- a delete during a launch ----------------------------------------------------------------------


async def test_a_start_cancelled_during_a_launch_records_the_node_then_is_cancelled(world: PoolWorld) -> None:
    world.apply(pool_spec(workers=1))
    world.fleet.launch_gate = asyncio.Event()
    await world.tick()
    pending = world.only(ClusterRole.PENDING)
    start = world.controller._background[pending.name]
    await world.fleet.launching.wait()
    start.cancel()
    await asyncio.sleep(0.01)
    assert not start.done()  # the launch under way is seen to its end
    world.fleet.launch_gate.set()
    with pytest.raises(asyncio.CancelledError):
        await start
    head, worker = world.cluster(pending.name).nodes
    assert head.pid is not None and world.fleet.running[head.temp_dir].pid == head.pid  # recorded
    assert worker.pid is None and worker.temp_dir not in world.fleet.running  # not launched after the cancel


async def test_a_delete_during_a_launch_stops_the_node_once_it_is_recorded(world: PoolWorld) -> None:
    world.apply(pool_spec(workers=1))
    world.fleet.launch_gate = asyncio.Event()
    await world.tick()
    pending = world.only(ClusterRole.PENDING)
    await world.fleet.launching.wait()
    stops_before = len(world.fleet.stopped)  # the start's own stop by tag, before its launch
    world.store.mark_deleting(NAME)
    await world.tick()  # deletes the cluster: its start is cancelled, its stop begins
    assert world.controller._background[pending.name].get_name() == f"stop-{pending.name}"
    await asyncio.sleep(0.01)
    assert len(world.fleet.stopped) == stops_before  # the stop waits for the launch under way
    world.fleet.launch_gate.set()
    await world.background_settled()
    assert world.fleet.running == {}  # no node outlives its cluster
    assert world.store.get_cluster(pending.name) is None
    head = next(node for node in world.fleet.stopped[stops_before:] if node.role == "head")
    assert head.pid > 0  # stopped by the pid the start recorded
