"""A head that moves host (issue 20: GCS tables in Redis), tick by tick (the real Controller and
PoolProvider, the SSH side and the Redis faked): once its host has been silent past
`headMoveAfterSeconds`, the head (and any node on that host) is placed on another host, the
workers elsewhere are started again against it, and what was left on the silent host is stopped
once it answers; never before the time, never with RocksDB, never for a pinned head."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from servekeeper.core.planner import MAX_WORKER_RESTARTS
from servekeeper.model.cluster_spec import HEAD_MOVE_AFTER_SECONDS, RayClusterConfigSpec
from servekeeper.model.enums import ClusterRole
from servekeeper.model.hostpool import parse_host_pool
from servekeeper.model.records import ClusterRecord
from servekeeper.providers import gcs_storage
from servekeeper.providers.gcs_storage import GcsStorage
from servekeeper.providers.local_monitor import NodeApi
from servekeeper.providers.redis_server import RedisTarget
from tests.unit.ssh_fakes import pool_document
from tests.unit.test_controller import make_spec
from tests.unit.test_gcs_redis import FakeRedisServer
from tests.unit.test_pool_clusters import PoolWorld, world

__all__ = ["world"]  # the fixture, shared

MOVE_AFTER = 5.0


def moving_spec(
    backend: str = "redis", head_host: str | None = None, autoscaled: bool = False, **fault_tolerance: Any
) -> Any:
    settings: dict[str, Any] = {"backend": backend, **fault_tolerance}
    if backend == "redis":
        settings.setdefault("headMoveAfterSeconds", MOVE_AFTER)
    group: dict[str, Any] = {"name": "w", "replicas": 2, "numCpus": 2}
    if autoscaled:
        group.update(minReplicas=0, maxReplicas=4)
    shape = {
        "hostPool": "fleet",
        "head": {"numCpus": 1, "host": head_host},
        "workerGroups": [group],
        "gcsFaultTolerance": settings,
        "enableInTreeAutoscaling": autoscaled,
    }
    return make_spec(rayClusterConfig=shape)


async def _running(world: PoolWorld, tmp_path: Path, spec: Any, kept: bool = True, hosts: str = "abc") -> ClusterRecord:
    document = pool_document(*((name, 4.0) for name in hosts))
    world.store.apply_host_pool("fleet", parse_host_pool(document).to_json(), world.clock())

    def tables(target: RedisTarget, namespace: str) -> bool:
        return kept

    world.pools.gcs_storage = GcsStorage(tmp_path, server=FakeRedisServer(), route=lambda _: "10.0.0.1", kept=tables)
    world.apply(spec)
    await world.tick()
    await world.background_settled()
    cluster = world.only(ClusterRole.PENDING)
    assert all(node.pid is not None for node in cluster.nodes)
    return cluster


async def _silent_for(world: PoolWorld, host: str, seconds: float) -> None:
    """The host falls silent; looks at it for `seconds` of the controller's clock."""
    world.fleet.silent.add(host)
    world.pools._liveness.clear()
    await world.tick()  # the first look that finds it silent
    world.clock.advance(seconds)
    world.pools._liveness.clear()
    await world.tick()
    await world.background_settled()


async def test_a_head_on_a_silent_host_moves_with_its_tables_and_the_workers_follow_it(
    world: PoolWorld, tmp_path: Path
) -> None:
    before = await _running(world, tmp_path, moving_spec())
    head, *workers = before.nodes
    await _silent_for(world, head.host, MOVE_AFTER - 1)
    assert world.cluster(before.name).nodes[0] == head, "not before headMoveAfterSeconds"
    await _silent_for(world, head.host, 1)
    moved = world.cluster(before.name)
    new_head = moved.nodes[0]
    assert new_head.host != head.host and new_head.pid is not None and new_head.restarts == 1
    assert new_head.temp_dir.endswith("/n0.1"), "a dir of its own: the old head is stopped by its own tag"
    env = world.fleet.envs[new_head.temp_dir]
    assert env["RAY_external_storage_namespace"] == before.name, "the same tables, in the same namespace"
    assert moved.gcs_address == f"{new_head.address}:{moved.ports.gcs}"
    for old, now in zip(workers, moved.nodes[1:], strict=True):
        assert (now.host, now.temp_dir, now.restarts) == (old.host, old.temp_dir, old.restarts)
        assert now.pid not in (None, old.pid), "started again against the new head"
        assert moved.gcs_address in " ".join(world.fleet.argvs[now.temp_dir])
    assert (moved.ports.serve_http, moved.ports.serve_grpc) == (before.ports.serve_http, before.ports.serve_grpc)
    assert moved.left_behind == (head,), "the old head may still run on its silent host"
    endpoints = world.pools.endpoints(moved, grpc=False)
    assert [(e.host, e.fallback) for e in endpoints] == [(new_head.address, True)] + [
        (node.address, False) for node in moved.nodes[1:] if node.address != new_head.address
    ], "the head's proxy only while no worker's is healthy"
    assert world.service().failure_reason is None and len(world.clusters()) == 1, "the cluster is kept"
    reasons = world.reasons()
    assert reasons.count("HeadMoving") == 1 and reasons.count("HeadRestarted") == 1

    world.fleet.silent.discard(head.host)  # the host answers again: what ran there is stopped
    world.pools._liveness.clear()
    await world.tick()
    assert world.cluster(before.name).left_behind == ()
    assert any(node.temp_dir == head.temp_dir and node.pid == head.pid for node in world.fleet.stopped)
    assert head.temp_dir not in world.fleet.running and new_head.temp_dir in world.fleet.running


async def test_serve_ports_taken_on_a_new_host_are_allocated_anew_for_the_whole_cluster(
    world: PoolWorld, tmp_path: Path
) -> None:
    before = await _running(world, tmp_path, moving_spec(), hosts="abcd")
    spare = ({"a", "b", "c", "d"} - {node.host for node in before.nodes}).pop()
    world.fleet.taken_ports[spare] = {before.ports.serve_http}
    world.store.update_cluster(before.name, role=ClusterRole.ACTIVE)  # serving: in the route
    await world.tick()
    await _silent_for(world, before.nodes[0].host, MOVE_AFTER)
    moved = world.cluster(before.name)
    assert moved.nodes[0].host == spare, "the host with the most room, none of the cluster's"
    assert moved.ports.serve_http != before.ports.serve_http
    assert all(node.pid is not None for node in moved.nodes)
    await world.tick()  # the route is pushed again with the moved endpoints
    (backend,) = [b for b in world.dataplane.desired["svc"].backends if b.name == before.name]
    assert {(e.host, e.port) for e in backend.http} == {(n.address, moved.ports.serve_http) for n in moved.nodes}


class ForgettingRedisServer(FakeRedisServer):
    def __init__(self) -> None:
        super().__init__()
        self.forgotten: list[str] = []

    def forget_user(self, cluster: str) -> None:
        self.forgotten.append(cluster)


async def test_a_deleted_cluster_is_gone_only_once_what_a_move_left_is_stopped(
    world: PoolWorld, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    removed: list[str] = []
    monkeypatch.setattr(gcs_storage, "delete_namespace", lambda target, namespace: removed.append(namespace) or 1)
    before = await _running(world, tmp_path, moving_spec())
    server = ForgettingRedisServer()
    world.pools.gcs_storage = GcsStorage(tmp_path, server=server, route=lambda _: "10.0.0.1", kept=lambda *_: True)
    await _silent_for(world, before.nodes[0].host, MOVE_AFTER)
    assert world.cluster(before.name).left_behind
    world.store.mark_deleting(world.service().name)
    for _ in range(3):
        await world.tick()
        await world.background_settled()
    assert world.store.get_cluster(before.name) is not None, "its old head may still run: not forgotten"
    assert "ClusterStopIncomplete" in world.reasons()
    world.fleet.silent.clear()
    for _ in range(3):
        await world.tick()
        await world.background_settled()
    assert world.store.get_cluster(before.name) is None
    assert before.nodes[0].temp_dir not in world.fleet.running
    assert removed == [before.name] and server.forgotten == [before.name], "its tables and user went with it"


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        pytest.param(moving_spec(backend="rocksdb"), "its tables are on that host", id="rocksdb"),
        pytest.param(moving_spec(head_host="a"), "pinned", id="pinned"),
    ],
)
async def test_a_head_does_not_move_when_it_cannot(world: PoolWorld, tmp_path: Path, spec: Any, why: str) -> None:
    before = await _running(world, tmp_path, spec)
    await _silent_for(world, before.nodes[0].host, 20)  # past MOVE_AFTER, within the unhealthy threshold
    await _silent_for(world, before.nodes[0].host, 1)
    assert world.cluster(before.name).nodes[0] == before.nodes[0], why
    assert "HeadMoving" not in world.reasons()
    failed = [event.message for event in world.events() if event.reason == "HeadMoveFailed"]
    if why == "pinned":  # told once, not at every tick
        assert len(failed) == 1 and "no host of pool 'fleet' can take the nodes on silent host a" in failed[0], failed
    else:
        assert failed == [], "a RocksDB head is never asked to move"


async def test_a_move_that_cannot_be_made_is_tried_again_after_a_doubling_delay(
    world: PoolWorld, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each try probes hosts under the pool's placement lock: not at every tick."""
    before = await _running(world, tmp_path, moving_spec(head_host="a"))
    tries: list[float] = []
    move_head = world.pools.move_head

    async def counted(cluster: ClusterRecord, config: RayClusterConfigSpec) -> ClusterRecord:
        tries.append(world.clock())
        return await move_head(cluster, config)

    monkeypatch.setattr(world.pools, "move_head", counted)
    await _silent_for(world, before.nodes[0].host, MOVE_AFTER)
    first = len(tries)
    assert first == 1, tries

    async def ticks_after(seconds: float) -> int:
        world.clock.advance(seconds)
        world.pools._liveness.clear()
        await world.tick()
        await world.background_settled()
        return len(tries)

    assert await ticks_after(1) == 1, "not at the next tick"
    assert await ticks_after(4) == 2, "after 5 s"
    assert await ticks_after(5) == 2, "then after 10 s"
    assert await ticks_after(5) == 3
    failed = [event.message for event in world.events() if event.reason == "HeadMoveFailed"]
    assert len(failed) == 1 and "trying again in 5s" in failed[0], failed


async def test_a_move_counts_against_the_heads_restart_budget(world: PoolWorld, tmp_path: Path) -> None:
    before = await _running(world, tmp_path, moving_spec())
    head = replace(before.nodes[0], restarts=MAX_WORKER_RESTARTS)
    world.store.update_cluster(before.name, nodes=(head, *before.nodes[1:]))
    await _silent_for(world, head.host, MOVE_AFTER)
    assert world.cluster(before.name).nodes[0] == head, "no restart left"


def test_head_move_after_is_for_redis_and_left_out_of_the_hash_when_unset() -> None:
    with pytest.raises(ValidationError, match="headMoveAfterSeconds is for backend: redis"):
        RayClusterConfigSpec.model_validate({"gcsFaultTolerance": {"headMoveAfterSeconds": 10}})
    redis = make_spec(rayClusterConfig={"hostPool": "fleet", "gcsFaultTolerance": {"backend": "redis"}})
    assert redis.spec.rayClusterConfig.gcsFaultTolerance is not None
    assert redis.spec.rayClusterConfig.gcsFaultTolerance.head_move_after() == HEAD_MOVE_AFTER_SECONDS
    assert "headMoveAfterSeconds" not in redis.spec.rayClusterConfig.gcsFaultTolerance.hash_shape()


async def test_the_heads_proxy_is_a_fallback_only_on_a_cluster_whose_head_comes_back(
    world: PoolWorld, tmp_path: Path
) -> None:
    shape = {"hostPool": "fleet", "head": {"numCpus": 1}, "workerGroups": [{"name": "w", "replicas": 2, "numCpus": 2}]}
    plain = await _running(world, tmp_path, make_spec(rayClusterConfig=shape))
    endpoints = world.pools.endpoints(plain, grpc=True)
    assert len(endpoints) == 3 and not any(e.fallback for e in endpoints), "a dead head is replaced, never back"
    assert {e.port for e in endpoints} == {plain.ports.serve_grpc}


async def test_an_autoscaled_head_moves_to_a_host_without_a_node_of_its_cluster(
    world: PoolWorld, tmp_path: Path
) -> None:
    """Each node of an autoscaled pool cluster runs Serve's proxy on the cluster's ports: the head
    moves to a host none of its nodes is on, and a node Ray asked for (beyond the count the spec
    starts with) takes its group's room there."""
    world.pools.monitors.node_api = NodeApi("http://127.0.0.1:8765", "secret")
    before = await _running(world, tmp_path, moving_spec(autoscaled=True), hosts="abcde")
    config = RayClusterConfigSpec.model_validate_json(before.cluster_spec_json)
    grown, [launched] = await world.pools.launch_nodes(before, config, "w", 1, world.store)
    await world.tick()  # the node Ray asked for is started
    await world.background_settled()
    hosts = [node.host for node in world.cluster(before.name).nodes]
    assert len(set(hosts)) == 4 and [n.node_id for n in grown.nodes][-1] == launched
    await _silent_for(world, hosts[0], MOVE_AFTER)
    moved = world.cluster(before.name)
    (free,) = set("abcde") - set(hosts)
    assert moved.nodes[0].host == free and moved.nodes[0].pid is not None, "the one host without a node of it"
