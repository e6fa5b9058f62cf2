"""GCS fault tolerance on a host pool, tick by tick (the real Controller and PoolProvider, the SSH
side faked): a head that exited is started again in place with its GCS store, never on an empty
store, never beside a process of the old one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from servekeeper.model.enums import ClusterRole
from servekeeper.model.records import ClusterRecord
from servekeeper.providers.base import launched_into
from servekeeper.providers.node_argv import GCS_RECONNECT_SECONDS, gcs_storage_dir
from tests.unit.test_controller import make_spec
from tests.unit.test_pool_clusters import PoolWorld, world

__all__ = ["world"]  # the fixture, shared


async def _kept_pending(world: PoolWorld) -> ClusterRecord:
    shape = {
        "hostPool": "fleet",
        "head": {"numCpus": 2},
        "workerGroups": [{"name": "w", "replicas": 1, "numCpus": 2}],
        "gcsFaultTolerance": {"backend": "rocksdb"},
    }
    world.apply(make_spec(rayClusterConfig=shape))
    await world.tick()
    await world.background_settled()
    pending = world.only(ClusterRole.PENDING)
    assert all(node.pid is not None for node in pending.nodes)
    return pending


async def _head_exits(world: PoolWorld, pending: ClusterRecord) -> None:
    del world.fleet.running[pending.nodes[0].temp_dir]  # its host answered: the head exited
    world.pools._liveness.clear()
    await world.tick()
    await world.background_settled()


async def test_the_head_keeps_its_gcs_in_rocksdb_beside_its_temp_dir_and_workers_wait_for_it(
    world: PoolWorld,
) -> None:
    pending = await _kept_pending(world)
    head, worker = pending.nodes
    assert world.fleet.envs[head.temp_dir]["RAY_gcs_storage"] == "rocksdb"
    assert world.fleet.envs[head.temp_dir]["RAY_gcs_storage_path"] == f"{head.temp_dir}.gcs"
    assert world.fleet.envs[worker.temp_dir]["RAY_gcs_rpc_server_reconnect_timeout_s"] == str(GCS_RECONNECT_SECONDS)
    assert "RAY_gcs_storage" not in world.fleet.envs[worker.temp_dir]


async def test_a_head_that_exited_is_started_again_in_place_not_a_failed_rollout(world: PoolWorld) -> None:
    pending = await _kept_pending(world)
    head, worker = pending.nodes
    await _head_exits(world, pending)
    now = world.cluster(pending.name)
    assert world.service().failure_reason is None, "not HeadDied: started again"
    again = now.nodes[0]
    assert (again.host, again.temp_dir, again.ports, again.restarts) == (head.host, head.temp_dir, head.ports, 1)
    assert again.pid not in (None, head.pid) and now.head_pid == again.pid
    assert now.nodes[1] == worker, "the worker untouched: it reconnects"
    assert ("gcs_kept", gcs_storage_dir(head.temp_dir)) in world.fleet.calls
    reasons = world.reasons()
    assert reasons.count("HeadRestarting") == 1 and reasons.count("HeadRestarted") == 1


async def test_a_head_whose_gcs_store_is_gone_is_not_started_on_an_empty_one(world: PoolWorld) -> None:
    pending = await _kept_pending(world)
    head = pending.nodes[0]
    world.fleet.gcs_lost.add(gcs_storage_dir(head.temp_dir))  # its host rebooted, /tmp wiped
    launches = world.fleet.calls.count(("launch", head.temp_dir))
    await _head_exits(world, pending)
    assert world.fleet.calls.count(("launch", head.temp_dir)) == launches, "no head on an empty store"
    await world.tick()
    reason = world.service().failure_reason or ""
    assert "GCS state of the head on host" in reason and "is gone" in reason, reason
    assert "HeadRestarted" not in world.reasons()


@pytest.mark.parametrize("role", [0, 1], ids=["head", "worker"])
async def test_a_node_is_not_started_again_beside_a_process_of_the_old_one(world: PoolWorld, role: int) -> None:
    pending = await _kept_pending(world)
    node = pending.nodes[role]
    world.fleet.leftovers[node.temp_dir] = [4242]  # survives the stop by its tag
    launches = world.fleet.calls.count(("launch", node.temp_dir))
    del world.fleet.running[node.temp_dir]
    world.pools._liveness.clear()
    await world.tick()
    await world.background_settled()
    assert world.fleet.calls.count(("launch", node.temp_dir)) == launches
    await world.tick()
    reason = world.service().failure_reason or ""
    assert "[4242]" in reason and "did not stop; not starting it again" in reason, reason


async def test_a_serving_head_whose_gcs_store_is_gone_is_not_tried_again(world: PoolWorld) -> None:
    shape = {"hostPool": "fleet", "head": {"numCpus": 2}, "gcsFaultTolerance": {"backend": "rocksdb"}}
    active = await world.roll_out(make_spec(rayClusterConfig=shape, serviceUnhealthySecondThreshold=86400))
    head = active.nodes[0]
    world.fleet.gcs_lost.add(gcs_storage_dir(head.temp_dir))
    launches = world.fleet.calls.count(("launch", head.temp_dir))
    for _ in range(120):  # two minutes of ticks: a permanent error is not retried
        world.pools._liveness.clear()
        world.fleet.running.pop(head.temp_dir, None)  # the head exited (and stays gone); host a answers
        await world.tick()
        await world.background_settled()
        world.clock.advance(1)
    assert world.fleet.calls.count(("launch", head.temp_dir)) == launches, "no head on an empty store"
    [failed] = [e.message for e in world.events() if e.reason == "NodeStartFailed"]
    assert "is gone" in failed and "not tried again" in failed, failed


async def test_a_start_under_way_keeps_a_restart_a_tick_recorded_meanwhile(world: PoolWorld) -> None:
    """A start records every node as it knows them; a tick that cleared another node's pid
    meanwhile (it exited: started again) must not see that pid come back."""
    pending = await _kept_pending(world)
    head, worker = pending.nodes
    cleared = world.controller.executor.provider.restarted(world.cluster(pending.name), [worker.pid or -1])
    world.store.update_cluster(pending.name, nodes=cleared.nodes, worker_pids=cleared.worker_pids)
    # A start that began from the record before the restart, and launched the head again.
    relaunched = (replace(head, pid=999, session_id=999), worker)
    merged = launched_into(world.cluster(pending.name), pending, relaunched)
    assert merged.nodes[0].pid == 999 and merged.head_pid == 999
    assert merged.nodes[1].pid is None and merged.nodes[1].restarts == 1 and merged.worker_pids == ()
