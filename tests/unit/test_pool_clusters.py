"""Clusters on a host pool, tick by tick: the real `Controller` and `PoolProvider` on a real
SQLite store, the SSH side faked (tests/unit/ssh_fakes.py). What happens when a host refuses,
when a delete comes during a launch, and what a partly stopped cluster still takes."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from servekeeper.controller.loop import Controller
from servekeeper.core.planner import MAX_WORKER_RESTARTS
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.enums import ClusterRole
from servekeeper.model.hostpool import parse_host_pool
from servekeeper.model.records import ClusterRecord, NodePlacement
from servekeeper.providers.cluster_token import read_cluster_token
from servekeeper.providers.pool import PoolProvider
from servekeeper.providers.pool_placement import HostRefused, Shortfall, place_cluster
from servekeeper.providers.ports import PortAllocator
from servekeeper.providers.router import ProviderRouter
from servekeeper.providers.ssh import CommandFailed, HostKeyRefused, HostUnreachable
from servekeeper.store.store import Store
from servekeeper.views.hosts import usage
from tests.unit.fakes import FakeClock, FakeDataPlane, FakeProvider, FakeServe
from tests.unit.ssh_fakes import FakeFleet, FakeSshConnection, pool_document
from tests.unit.test_controller import NAME, World, make_spec
from tests.unit.test_ssh import PORTS


class PoolWorld(World):
    fleet: FakeFleet
    pools: PoolProvider


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[PoolWorld]:
    store = Store(tmp_path / "servekeeper.db")
    store.apply_host_pool("fleet", parse_host_pool(pool_document(("a", 4), ("b", 4))).to_json(), 1.0)
    session = aiohttp.ClientSession()
    provider, serve, dataplane, clock = FakeProvider(), FakeServe(), FakeDataPlane(), FakeClock()
    fleet = FakeFleet()
    pools = PoolProvider(store, tmp_path, ssh_nodes=fleet)
    controller = Controller(
        store,
        ProviderRouter(provider, pools),
        dataplane,
        session,
        tmp_path,
        clock=clock,
        serve=serve,  # type: ignore[arg-type]
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
    start = world.controller.executor.background[pending.name]
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
    assert world.controller.executor.background[pending.name].get_name() == f"stop-{pending.name}"
    await asyncio.sleep(0.01)
    assert len(world.fleet.stopped) == stops_before  # the stop waits for the launch under way
    world.fleet.launch_gate.set()
    await world.background_settled()
    assert world.fleet.running == {}  # no node outlives its cluster
    assert world.store.get_cluster(pending.name) is None
    head = next(node for node in world.fleet.stopped[stops_before:] if node.role == "head")
    assert head.pid > 0  # stopped by the pid the start recorded


# -- a partly stopped cluster ------------------------------------------------------------------------


def draft(name: str, config: RayClusterConfigSpec) -> ClusterRecord:
    return ClusterRecord(
        name=name,
        service=name,
        generation=1,
        cluster_spec_hash="h",
        cluster_spec_json=config.model_dump_json(),
        role=ClusterRole.PENDING,
        ports=PortAllocator([]).cluster(worker_nodes=config.worker_count()),
        temp_dir="/tmp/sk-x",
        log_dir="/tmp/sk-x-logs",
        created_at=0.0,
    )


async def started(
    pools: PoolProvider, store: Store, name: str, config: RayClusterConfigSpec, service: str | None = None
) -> ClusterRecord:
    cluster = await pools.new_record(replace(draft(name, config), service=service or name), config, store)
    pools.put_new(cluster, store)

    def record(**changes: Any) -> None:
        store.update_cluster(name, nodes=changes["nodes"])

    await pools.start_nodes(cluster, config, record)
    return store.get_cluster(name)  # type: ignore[return-value]


async def test_a_node_stopped_for_sure_frees_its_room_while_another_resists(tmp_path: Path, store: Store) -> None:
    store.apply_host_pool("fleet", parse_host_pool(pool_document(("a", 4), ("b", 4))).to_json(), 1.0)
    fleet = FakeFleet()
    pools = PoolProvider(store, tmp_path, ssh_nodes=fleet)
    whole_pool = pool_spec(workers=1, cpus=4).spec.rayClusterConfig
    old = await started(pools, store, "old", whole_pool)
    head, worker = old.nodes
    assert (head.host, worker.host) == ("a", "b")
    fleet.leftovers[worker.temp_dir] = [4242]  # survives SIGKILL on b

    def record(**changes: Any) -> None:
        store.update_cluster("old", nodes=changes["nodes"])

    assert await pools.stop(old, record) == ["b:4242"]
    head, worker = store.get_cluster("old").nodes  # type: ignore[union-attr]
    assert head.stopped and not worker.stopped  # the cluster stays on record: b still runs a node of it
    used_by = usage(store.list_clusters(), "fleet")
    assert [(host, [u["cluster"] for u in used]) for host, used in used_by.items()] == [("b", ["old"])]

    one_host = pool_spec(workers=0, cpus=4).spec.rayClusterConfig
    new = await pools.new_record(draft("new", one_host), one_host, store)
    assert [node.host for node in new.nodes] == ["a"]  # the room the stopped head left

    del fleet.leftovers[worker.temp_dir]
    stops = len(fleet.stopped)
    assert await pools.stop(store.get_cluster("old"), record) == []  # type: ignore[arg-type]
    assert [node.temp_dir for node in fleet.stopped[stops:]] == [worker.temp_dir]  # the head is not stopped again
    await pools.close()


def test_a_node_stored_before_the_stopped_flag_reads_as_not_stopped() -> None:
    node = NodePlacement("a", "10.0.0.11", "head", PORTS, "/tmp/servekeeper/c/n0", pid=5, session_id=5)
    stored = node.to_json()
    del stored["stopped"]
    assert NodePlacement.from_json(stored) == node and not node.stopped
    assert NodePlacement.from_json(replace(node, stopped=True).to_json()).stopped


# -- what is left behind -----------------------------------------------------------------------------


async def test_a_services_second_cluster_goes_where_its_first_is_not(tmp_path: Path, store: Store) -> None:
    """A standby (or an upgrade's cluster) is placed away from the active's hosts while room
    allows, even where another host has more room; another service's cluster is not held back."""
    store.apply_host_pool("fleet", parse_host_pool(pool_document(("a", 8), ("b", 4))).to_json(), 1.0)
    pools = PoolProvider(store, tmp_path, ssh_nodes=FakeFleet())
    head_only = pool_spec(workers=0, cpus=1).spec.rayClusterConfig
    active = await started(pools, store, "svc-1", head_only, service="svc")
    assert [node.host for node in active.nodes] == ["a"]
    standby = await pools.new_record(replace(draft("svc-2", head_only), service="svc"), head_only, store)
    assert [node.host for node in standby.nodes] == ["b"]
    other = await pools.new_record(draft("other", head_only), head_only, store)
    assert [node.host for node in other.nodes] == ["a"], "the most room, for a cluster of another service"
    await pools.close()


async def test_a_changed_pool_closes_the_connections_of_hosts_that_changed(tmp_path: Path, store: Store) -> None:
    store.apply_host_pool("fleet", parse_host_pool(pool_document(("a", 4), ("b", 4))).to_json(), 1.0)
    pools = PoolProvider(store, tmp_path)  # the real SshNodes, over fake asyncssh connections
    before = pools.ssh("fleet")
    to_a, to_b = before.connection("a"), before.connection("b")
    open_a, open_b = FakeSshConnection(), FakeSshConnection()
    to_a._connection, to_b._connection = open_a, open_b  # type: ignore[assignment]

    more = pool_document(("a", 4), ("b", 8))  # b changed
    store.apply_host_pool("fleet", parse_host_pool(more).to_json(), 2.0)
    after = pools.ssh("fleet")
    assert after is not before and after.connection("a") is to_a  # unchanged host: the same connection
    assert after.connection("b") is not to_b
    for _ in range(100):
        if open_b.closed:
            break
        await asyncio.sleep(0.001)
    assert open_b.closed and not open_a.closed
    with pytest.raises(HostUnreachable, match="retired"):  # a call still under way on the old one
        await to_b.run(["true"])

    store.delete_host_pool("fleet")
    with pytest.raises(Shortfall):
        pools.ssh("fleet")
    await pools.close()
    assert open_a.closed


async def test_the_token_is_saved_with_the_record_and_goes_if_storing_fails(
    tmp_path: Path, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.apply_host_pool("fleet", parse_host_pool(pool_document(("a", 4))).to_json(), 1.0)
    pools = PoolProvider(store, tmp_path, ssh_nodes=FakeFleet())
    config = pool_spec(workers=0, cpus=1).spec.rayClusterConfig
    cluster = await pools.new_record(draft("c1", config), config, store)
    assert not (tmp_path / "tokens" / "c1.token").exists()  # placed, not stored: no token yet

    def disk_full(cluster: ClusterRecord) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(store, "put_cluster", disk_full)
    with pytest.raises(sqlite3.OperationalError):
        pools.put_new(cluster, store)
    assert not (tmp_path / "tokens" / "c1.token").exists()
    monkeypatch.undo()
    pools.put_new(cluster, store)
    assert store.get_cluster("c1") is not None and len(read_cluster_token(tmp_path / "tokens", "c1")) == 64
    await pools.close()


# -- a worker node that exits ------------------------------------------------------------------------


async def _running_pending(world: PoolWorld) -> ClusterRecord:
    world.apply(pool_spec(workers=1))  # head on host a, worker on host b
    await world.tick()
    await world.background_settled()
    pending = world.only(ClusterRole.PENDING)
    assert all(node.pid is not None for node in pending.nodes)
    return pending


async def test_workers_are_launched_once_the_heads_gcs_answers(world: PoolWorld) -> None:
    pending = await _running_pending(world)
    head, worker = pending.nodes
    order = [call for call in world.fleet.calls if call[0] in ("launch", "gcs_answers")]
    assert order == [("launch", head.temp_dir), ("gcs_answers", head.host), ("launch", worker.temp_dir)]


async def test_a_head_whose_gcs_never_answers_gets_no_workers_and_fails_the_rollout(world: PoolWorld) -> None:
    world.fleet.gcs_silent.add("a")  # the head goes on host a
    world.apply(pool_spec(workers=1))
    await world.tick()
    await world.background_settled()
    [cluster] = world.clusters()
    assert (cluster.failure_reason or "").startswith("StartFailed: the head's GCS on host a did not answer on port")
    assert len([call for call in world.fleet.calls if call[0] == "launch"]) == 1, "the head only"


async def test_a_worker_that_exited_on_a_host_that_answers_is_started_again_there(world: PoolWorld) -> None:
    pending = await _running_pending(world)
    head, worker = pending.nodes
    del world.fleet.running[worker.temp_dir]  # its process exited; host b answers
    world.pools._liveness.clear()  # no cached look from before the exit
    await world.tick()
    await world.background_settled()
    now = world.cluster(pending.name)
    assert now.failure_reason is None and world.service().failure_reason is None
    assert now.nodes[0] == head, "the head untouched"
    again = now.nodes[1]
    assert (again.host, again.temp_dir, again.restarts) == (worker.host, worker.temp_dir, 1)
    assert again.pid is not None and again.pid != worker.pid and world.fleet.running[worker.temp_dir].pid == again.pid
    assert now.worker_pids == (again.pid,)
    assert "WorkerRestarting" in world.reasons()


async def test_a_worker_on_a_silent_host_is_not_restarted_and_fails_the_rollout_past_the_threshold(
    world: PoolWorld,
) -> None:
    pending = await _running_pending(world)
    world.fleet.silent.add(pending.nodes[1].host)
    world.pools._liveness.clear()
    await world.tick()
    assert world.service().failure_reason is None, "one silent look: unknown, not dead"
    for _ in range(31):  # silent on every look: lost past the unhealthy threshold (30 s)
        world.clock.advance(1)
        world.pools._liveness.clear()
        await world.tick()
    assert (world.service().failure_reason or "").startswith("WorkerUnreachable"), world.service().failure_reason
    assert "WorkerRestarting" not in world.reasons()
    assert not [call for call in world.fleet.calls if call == ("launch", pending.nodes[1].temp_dir)][1:]


def test_two_nodes_on_one_host_are_one_endpoint_of_the_ingress(tmp_path: Path, store: Store) -> None:
    ports = PortAllocator([]).cluster(worker_nodes=2)
    nodes = tuple(
        NodePlacement(host, address, role, ports.node_ports[i], f"/w/{i}", 100 + i)
        for i, (host, address, role) in enumerate(
            [("a", "10.0.0.11", "head"), ("b", "10.0.0.12", "worker"), ("b", "10.0.0.12", "worker")]
        )
    )
    cluster = draft("c", pool_spec(workers=2).spec.rayClusterConfig)
    cluster = cluster.with_changes(pool="fleet", nodes=nodes, ports=ports)
    endpoints = PoolProvider(store, tmp_path).endpoints(cluster, grpc=False)
    assert [(e.host, e.port) for e in endpoints] == [("10.0.0.11", ports.serve_http), ("10.0.0.12", ports.serve_http)]
    # the nodes on b released by Ray's autoscaler: no proxy there any more, no endpoint
    released = cluster.with_changes(nodes=(nodes[0], *(replace(node, stopped=True) for node in nodes[1:])))
    assert [e.host for e in PoolProvider(store, tmp_path).endpoints(released, grpc=False)] == ["10.0.0.11"]


# -- a silent host is not a dead one (issue 19, item 1) -------------------------------------------


async def test_a_pending_head_whose_host_is_silent_once_is_unknown_not_dead(world: PoolWorld) -> None:
    pending = await _running_pending(world)
    head_host = pending.nodes[0].host
    world.fleet.silent.add(head_host)  # one look: the head's host does not answer
    world.pools._liveness.clear()
    world.clock.advance(1)
    await world.tick()
    seen = world.controller.observations[NAME].clusters[pending.name]
    assert not seen.processes_alive and seen.head_silent_since == world.clock()
    assert world.service().failure_reason is None, world.service().failure_reason
    assert "RolloutFailed" not in world.reasons()

    world.fleet.silent.discard(head_host)  # it answers again: the head was running all along
    world.pools._liveness.clear()
    world.clock.advance(1)
    await world.tick()
    assert world.controller.observations[NAME].clusters[pending.name].head_silent_since is None
    assert world.service().failure_reason is None and world.only(ClusterRole.PENDING).name == pending.name

    world.fleet.silent.add(head_host)  # silent on every look from now on
    for _ in range(31):
        world.pools._liveness.clear()
        world.clock.advance(1)
        await world.tick()
    assert (world.service().failure_reason or "").startswith("HeadUnreachable"), world.service().failure_reason
    await world.background_settled()


# -- a worker restart that keeps failing (issue 19, item 12) ----------------------------------------


async def test_a_failing_worker_restart_backs_off_counts_its_tries_and_gives_up(world: PoolWorld) -> None:
    spec = make_spec(
        rayClusterConfig={"hostPool": "fleet", "head": {"numCpus": 2}, "workerGroups": [{"name": "w", "numCpus": 2}]},
        serviceUnhealthySecondThreshold=86400,  # not replaced meanwhile: only the restarts are looked at
    )
    active = await world.roll_out(spec)
    worker = active.nodes[1]
    del world.fleet.running[worker.temp_dir]  # the worker exited; host b answers
    world.fleet.fail_launch[worker.host] = CommandFailed(worker.host, ["ray"], 1, "ray: command not found")

    def tries() -> int:
        return world.fleet.calls.count(("launch", worker.temp_dir)) - 1  # less its first start

    def failures() -> list[str]:
        return [e.message for e in world.events() if e.reason == "NodeStartFailed"]

    async def run_for(seconds: int) -> None:
        for _ in range(seconds):
            world.pools._liveness.clear()
            await world.tick()
            await world.background_settled()
            world.clock.advance(1)

    await run_for(60)  # tries at 0 (the restart), then 5, 15 and 35 s later: not one a tick
    assert tries() == 4 and len(failures()) == 4, (tries(), failures())
    assert world.cluster(active.name).nodes[1].restarts == 4, "each try counts as a restart"
    assert "trying again in 5s" in failures()[0] and "trying again in 40s" in failures()[-1]
    await run_for(600)  # the fifth try (at 75 s) is the last: the node's restarts are spent
    assert tries() == MAX_WORKER_RESTARTS and len(failures()) == MAX_WORKER_RESTARTS
    assert "no tries left" in failures()[-1]
    assert world.cluster(active.name).nodes[1].restarts == MAX_WORKER_RESTARTS


# -- a node that exits says why (issue 19, item 0) --------------------------------------------------

LOG = "\n".join(f"line {i}" for i in range(1, 8)) + "\nRuntimeError: the raylet could not reach the GCS\n\n"


async def test_a_worker_that_exited_is_restarted_with_its_last_log_lines_in_the_event(world: PoolWorld) -> None:
    pending = await _running_pending(world)
    worker = pending.nodes[1]
    del world.fleet.running[worker.temp_dir]  # its process exited; host b answers
    world.fleet.logs[worker.temp_dir] = LOG
    world.pools._liveness.clear()
    await world.tick()
    [restarting] = [e.message for e in world.events() if e.reason == "WorkerRestarting"]
    assert restarting.endswith("line 4 | line 5 | line 6 | line 7 | RuntimeError: the raylet could not reach the GCS")
    assert "line 3" not in restarting, "the last 5 lines only"
    assert restarting.count("exited") == 1
    await world.background_settled()


async def test_a_pending_head_that_exited_fails_the_rollout_at_once_with_its_last_log_lines(world: PoolWorld) -> None:
    pending = await _running_pending(world)
    head = pending.nodes[0]
    del world.fleet.running[head.temp_dir]  # its host answered: the head exited (known, not silent)
    world.fleet.logs[head.temp_dir] = "x" * 2000 + "\nfatal: port 6379 already in use"
    world.pools._liveness.clear()
    await world.tick()
    reason = world.service().failure_reason or ""
    assert reason.startswith("HeadDied") and reason.endswith("fatal: port 6379 already in use"), reason
    assert len(reason) < 800, "the log's tail, bounded"
    [failed] = [e.message for e in world.events() if e.reason == "RolloutFailed"]
    assert "fatal: port 6379 already in use" in failed
    await world.background_settled()


async def test_no_env_value_of_the_cluster_reaches_the_event_from_a_nodes_log(world: PoolWorld) -> None:
    group = {"name": "w", "numCpus": 2, "env": {"API_KEY": "s3cr3t-value-42", "DEBUG": "1"}}
    world.apply(make_spec(rayClusterConfig={"hostPool": "fleet", "head": {"numCpus": 2}, "workerGroups": [group]}))
    await world.tick()
    await world.background_settled()
    worker = world.only(ClusterRole.PENDING).nodes[1]
    del world.fleet.running[worker.temp_dir]
    world.fleet.logs[worker.temp_dir] = "DEBUG=1\nauth failed with key s3cr3t-value-42\n"
    world.pools._liveness.clear()
    await world.tick()
    [restarting] = [e.message for e in world.events() if e.reason == "WorkerRestarting"]
    assert restarting.endswith("DEBUG=1 | auth failed with key ***"), restarting
    assert all("s3cr3t" not in e.message for e in world.events())
    await world.background_settled()


async def test_a_host_without_the_environments_python_is_left_out_of_placement_or_refused_by_name(
    tmp_path: Path, store: Store
) -> None:
    pool = parse_host_pool(pool_document(("a", 4), ("b", 4)))
    fleet = FakeFleet()
    fleet.interpreters["b"] = {"3.12": "/usr/bin/python3.12"}
    ssh = fleet(pool.spec.hosts)
    fits_on_a = pool_spec(workers=1, cpus=2, rayVersion="2.59.0", pythonVersion="3.11").spec.rayClusterConfig
    placed = await place_cluster(pool, ssh, [], draft("x", fits_on_a), fits_on_a)
    assert [node.host for node in placed.nodes] == ["a", "a"], "b has no Python 3.11"
    needs_b = pool_spec(workers=1, cpus=3, rayVersion="2.59.0", pythonVersion="3.11").spec.rayClusterConfig
    with pytest.raises(HostRefused, match=r"no Python 3.11 on hosts \['b'\]"):
        await place_cluster(pool, ssh, [], draft("y", needs_b), needs_b)
    own = pool_spec(workers=1, cpus=3).spec.rayClusterConfig  # the hosts' own Ray and Python
    placed = await place_cluster(pool, ssh, [], draft("z", own), own)
    assert sorted(node.host for node in placed.nodes) == ["a", "b"]
    assert [call for call in fleet.calls if call[0] == "interpreters"] == [
        ("interpreters", "a"),
        ("interpreters", "b"),
    ] * 2
