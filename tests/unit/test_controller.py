"""The controller's execute/persist layer, tick by tick: the real `Controller` on a real SQLite
store, with fakes of the provider, Ray's Serve API, the data plane and the clock (tests/unit/fakes.py).

The planner's decisions are tested in test_planner.py; here the questions are what the
controller does with them: the order of intent and effect, what stops a tick, what is
persisted, background work, the loops and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from servekeeper.controller import loop as controller_module
from servekeeper.controller.faults import CRASH_ENV, FAIL_PUTS_ENV, InjectedFaults, hooks_from_environment
from servekeeper.controller.loop import PENDING_TICK_SECONDS, Controller
from servekeeper.core.hooks import CRASH_POINTS, Hooks
from servekeeper.core.serve_config import desired_config_hash
from servekeeper.dataplane import Backend, DataPlaneError, Endpoint
from servekeeper.model.enums import ClusterRole, ConditionType
from servekeeper.model.records import ClusterRecord, Event, ServiceRecord
from servekeeper.model.spec import ServiceSpec, parse_spec
from servekeeper.providers.local_nodes import nodes_of
from servekeeper.rayapi.serve_api import PermanentServeError, RetryableServeError
from servekeeper.store.store import Store
from tests.unit.fakes import FakeClock, FakeDataPlane, FakeProvider, FakeServe

NAME = "svc"


def make_spec(msg: str = "v1", cpus: float = 1, workers: int = 0, **overrides: Any) -> ServiceSpec:
    cluster: dict[str, Any] = {"head": {"numCpus": cpus}}
    if workers:
        cluster["workerGroups"] = [{"name": "small", "replicas": workers}]
    body: dict[str, Any] = {
        "ingress": {"port": 8000},
        "rayClusterConfig": cluster,
        "serveConfig": {
            "applications": [{"name": "hello", "route_prefix": "/", "import_path": "hello:app", "args": {"msg": msg}}]
        },
        "rayClusterDeletionDelaySeconds": 60,
        "readinessTimeoutSeconds": 120,
        "serviceUnhealthySecondThreshold": 30,
    }
    body.update(overrides)
    return parse_spec(
        {"apiVersion": "servekeeper/v1alpha1", "kind": "RayService", "metadata": {"name": NAME}, "spec": body}
    )


@dataclass
class World:
    store: Store
    provider: FakeProvider
    serve: FakeServe
    dataplane: FakeDataPlane
    clock: FakeClock
    controller: Controller

    def apply(self, spec: ServiceSpec) -> ServiceRecord:
        service, _ = self.store.apply_spec(spec.name, spec.to_json(), self.clock())
        return service

    async def tick(self) -> float | None:
        return await self.controller.tick(NAME)

    def service(self) -> ServiceRecord:
        service = self.store.get_service(NAME)
        assert service is not None
        return service

    def clusters(self, role: ClusterRole | None = None) -> list[ClusterRecord]:
        return [c for c in self.store.list_clusters(NAME) if role is None or c.role == role]

    def cluster(self, name: str) -> ClusterRecord:
        cluster = self.store.get_cluster(name)
        assert cluster is not None, name
        return cluster

    def only(self, role: ClusterRole) -> ClusterRecord:
        [cluster] = self.clusters(role)
        return cluster

    def events(self) -> list[Event]:
        return self.store.list_events(NAME, limit=500)

    def reasons(self) -> list[str]:
        return [event.reason for event in self.events()]

    def ready(self) -> bool | None:
        condition = self.service().condition(ConditionType.READY)
        return None if condition is None else condition.status

    async def background_settled(self) -> None:
        """Wait (briefly, in real time) until every start and stop task has ended."""
        for _ in range(200):
            if not self.controller.executor.background:
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"background tasks still running: {self.controller.debug_state()}")

    async def roll_out(self, spec: ServiceSpec | None = None) -> ClusterRecord:
        """First apply up to the switch: create, PUT, RUNNING, route, Ready."""
        self.apply(spec or make_spec())
        await self.tick()
        await self.background_settled()
        self.clock.advance(1)
        await self.tick()
        self.serve.set_status("RUNNING")
        self.clock.advance(1)
        await self.tick()
        active = self.only(ClusterRole.ACTIVE)
        assert self.ready() is True
        assert self.service().observed_generation == self.service().generation
        return active


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    store = Store(tmp_path / "servekeeper.db")
    session = aiohttp.ClientSession()
    provider, serve, dataplane, clock = FakeProvider(), FakeServe(), FakeDataPlane(), FakeClock()
    controller = Controller(
        store,
        provider,
        dataplane,
        session,
        tmp_path,
        clock=clock,
        serve=serve,  # type: ignore[arg-type]
    )
    try:
        yield World(store, provider, serve, dataplane, clock, controller)
    finally:
        provider.release_workers()
        await controller.shutdown(stop_clusters=False)
        await session.close()
        store.close()
        leaked = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
        assert not leaked, f"tasks left running: {leaked}"


# -- first apply: intent before effect, applied means observed --------------------------------


async def test_first_apply_stores_intent_first_audits_the_put_and_switches_once_running(world: World) -> None:
    stored_at_start: list[ClusterRecord | None] = []
    given_to_start: list[ClusterRecord] = []

    def before_start(cluster: ClusterRecord) -> None:
        given_to_start.append(cluster)
        stored_at_start.append(world.store.get_cluster(cluster.name))

    world.provider.before_start_head = before_start
    audit_at_put: list[list[tuple[str, str, float]]] = []
    world.serve.on_put = lambda url, document: audit_at_put.append(world.store.list_submissions())
    spec = make_spec()
    world.apply(spec)

    assert await world.tick() == PENDING_TICK_SECONDS
    pending = world.only(ClusterRole.PENDING)
    assert stored_at_start == given_to_start  # the record was in the store before the start
    assert given_to_start[0].head_pid is None and pending.head_pid is not None
    assert world.provider.calls == [("start_head", pending.name)]
    assert world.ready() is False and world.service().observed_generation == 0

    world.clock.advance(1)
    await world.tick()
    desired = desired_config_hash(spec, None)
    [(url, document)] = world.serve.puts
    assert url == pending.dashboard_url
    assert audit_at_put == [[(pending.name, desired, world.clock())]]  # audited before it was sent
    assert world.store.submitted_document(pending.name, desired) == document
    pending = world.cluster(pending.name)
    assert pending.submitted_config_hash == desired
    assert pending.config_submitted_at == world.clock()
    assert pending.applied_config_hash is None  # acknowledged is not applied
    assert world.dataplane.set_calls == []

    world.clock.advance(1)
    await world.tick()  # Ray shows the document, its apps DEPLOYING
    pending = world.cluster(pending.name)
    assert pending.role == ClusterRole.PENDING
    assert pending.applied_config_hash == desired and pending.good_config_hash is None
    assert world.dataplane.set_calls == []
    assert world.ready() is False and world.service().observed_generation == 0

    world.serve.set_status("RUNNING")
    world.clock.advance(1)
    await world.tick()
    [route] = world.dataplane.set_calls
    assert (route.service, route.port, route.weights) == (NAME, 8000, {pending.name: 100})
    assert route.backends == (Backend(pending.name, http=(Endpoint("127.0.0.1", pending.ports.serve_http),)),)
    active = world.cluster(pending.name)
    assert active.role == ClusterRole.ACTIVE and active.good_config_hash == desired
    assert active.ready_at == world.clock()
    service = world.service()
    assert world.ready() is True and service.observed_generation == 1
    assert [c.type for c in service.conditions if c.status] == [ConditionType.READY]
    assert {"ClusterCreating", "ConfigSubmitted", "TrafficSwitched", "ReadyChanged"} <= set(world.reasons())
    assert len(world.serve.puts) == 1 and len(world.store.list_submissions()) == 1

    world.clock.advance(2)
    assert await world.tick() == controller_module.STEADY_TICK_SECONDS  # steady: nothing more to do
    assert len(world.serve.puts) == 1 and len(world.dataplane.set_calls) == 1


async def test_a_start_head_failure_is_the_clusters_failure_and_fails_the_rollout(world: World) -> None:
    world.provider.start_head_error = OSError("ray: command not found")
    world.apply(make_spec())
    await world.tick()
    pending = world.only(ClusterRole.PENDING)
    assert pending.head_pid is None
    assert pending.failure_reason == "StartFailed: ray: command not found"
    world.clock.advance(1)
    await world.tick()
    service = world.service()
    assert service.failed_generation == 1 and service.failure_reason == "StartFailed: ray: command not found"
    assert "RolloutFailed" in world.reasons()
    await world.background_settled()
    assert world.clusters() == []  # deleted


# -- config PUTs: retryable, lost, rejected ------------------------------------------------------


async def test_a_retryable_put_failure_stops_the_tick_and_is_sent_again(world: World) -> None:
    world.apply(make_spec())
    await world.tick()
    pending = world.only(ClusterRole.PENDING)
    world.serve.put_errors = [RetryableServeError("PUT applications answered 503: busy")]
    world.clock.advance(1)
    await world.tick()
    assert world.serve.puts == []
    assert world.reasons()[-1] == "ConfigSubmitRetry"
    retry = world.events()[-1]
    assert retry.type == "Warning" and "503" in retry.message
    pending = world.cluster(pending.name)
    assert pending.config_submitted_at is None and pending.applied_config_hash is None
    assert len(world.store.list_submissions()) == 1  # the attempt is audited all the same

    world.clock.advance(1)
    await world.tick()  # not acknowledged: sent again at once
    assert [url for url, _ in world.serve.puts] == [pending.dashboard_url]
    assert len(world.store.list_submissions()) == 2
    assert world.cluster(pending.name).config_submitted_at == world.clock()


async def test_a_failed_put_stops_everything_planned_after_it_in_that_tick(world: World) -> None:
    active = await world.roll_out()
    world.apply(make_spec(cpus=2))  # a new cluster spec: a new cluster
    world.clock.advance(1)
    await world.tick()
    pending = world.only(ClusterRole.PENDING)
    world.dataplane.table.clear()  # the data plane lost its routes: the plan repairs them after the PUT
    world.serve.put_errors = [RetryableServeError("PUT applications answered 503")]
    set_calls = len(world.dataplane.set_calls)
    world.clock.advance(1)
    await world.tick()
    assert world.reasons()[-1] == "ConfigSubmitRetry"
    assert len(world.dataplane.set_calls) == set_calls  # the route repair did not run
    world.clock.advance(1)
    await world.tick()
    assert world.serve.puts[-1][0] == pending.dashboard_url
    assert world.dataplane.set_calls[-1].weights == {active.name: 100}  # now it did


async def test_observed_generation_waits_for_ray_to_run_the_new_config(world: World) -> None:
    active = await world.roll_out()
    world.apply(make_spec(msg="v2"))  # a Serve config change: in place on the active cluster
    new_hash = desired_config_hash(make_spec(msg="v2"), None)
    world.serve.put_errors = [RetryableServeError("PUT applications answered 503")]
    world.clock.advance(1)
    await world.tick()
    assert world.reasons()[-1] == "ConfigSubmitRetry"
    assert world.service().observed_generation == 1

    world.serve.defer = True  # Ray acknowledges the PUT but still runs the old config
    world.clock.advance(1)
    await world.tick()
    assert world.serve.puts[-1][0] == active.dashboard_url
    for _ in range(3):
        world.clock.advance(1)
        await world.tick()
        assert world.service().observed_generation == 1
        assert world.cluster(active.name).applied_config_hash != new_hash
    assert len(world.serve.puts) == 2  # acknowledged a moment ago: not sent again meanwhile

    world.serve.deploy_deferred(status="DEPLOYING")
    world.clock.advance(1)
    await world.tick()
    assert world.cluster(active.name).applied_config_hash == new_hash
    assert world.service().observed_generation == 1  # the new config runs, but is not RUNNING

    world.serve.set_status("RUNNING")
    world.clock.advance(1)
    await world.tick()
    assert world.service().observed_generation == 2
    assert world.cluster(active.name).good_config_hash == new_hash


async def test_a_rejected_in_place_change_fails_the_generation_and_is_not_overwritten(world: World) -> None:
    active = await world.roll_out()
    world.apply(make_spec(msg="v2"))
    world.serve.put_errors = [PermanentServeError(400, "cannot import hello:nope")]
    world.clock.advance(1)
    await world.tick()
    service = world.service()
    assert service.generation == 2
    assert service.failed_generation == 2
    assert service.failure_reason == "ConfigRejected: cannot import hello:nope"
    assert world.events()[-1].reason == "ConfigRejected" and world.events()[-1].type == "Warning"

    for _ in range(2):
        world.clock.advance(1)
        await world.tick()
        service = world.service()
        assert service.failed_generation == 2
        assert service.failure_reason == "ConfigRejected: cannot import hello:nope"
        rollout_failed = service.condition(ConditionType.ROLLOUT_FAILED)
        assert rollout_failed is not None and rollout_failed.status
        assert rollout_failed.reason == "ConfigRejected"
        assert service.observed_generation == 2
    assert len(world.serve.puts) == 1  # not retried blindly
    assert world.only(ClusterRole.ACTIVE).name == active.name
    assert world.ready() is True  # the active keeps serving what it ran


async def test_a_rejected_config_on_a_pending_cluster_fails_that_cluster(world: World) -> None:
    world.apply(make_spec())
    await world.tick()
    pending = world.only(ClusterRole.PENDING)
    world.serve.put_errors = [PermanentServeError(400, "bad config")]
    world.clock.advance(1)
    await world.tick()
    assert world.cluster(pending.name).failure_reason == "ConfigRejected: bad config"
    world.clock.advance(1)
    await world.tick()
    assert world.service().failed_generation == 1
    assert "RolloutFailed" in world.reasons()
    await world.background_settled()
    assert world.clusters() == []
    assert ("stop", pending.name) in world.provider.calls


# -- persist: what the API stored during a tick wins ----------------------------------------


async def test_a_spec_applied_during_a_tick_is_not_overwritten_by_its_status(world: World) -> None:
    active = await world.roll_out()
    before = world.service()
    world.serve.set_status("DEPLOY_FAILED", "replica crashed")  # this tick would mark it unhealthy

    def api_applies_v2(url: str) -> None:
        world.serve.on_applications = None
        world.apply(make_spec(msg="v2"))

    world.serve.on_applications = api_applies_v2
    world.clock.advance(1)
    await world.tick()
    service = world.service()
    assert service.generation == 2 and service.spec_json == make_spec(msg="v2").to_json()
    # Nothing the stale tick decided was written over the newer spec.
    assert service.unhealthy_since is None
    assert service.conditions == before.conditions
    assert service.observed_generation == 1

    world.serve.set_status("RUNNING")
    world.clock.advance(1)
    await world.tick()  # the next tick acts on the newer spec
    assert world.serve.puts[-1][0] == active.dashboard_url
    assert world.serve.puts[-1][1]["applications"][0]["args"] == {"msg": "v2"}


async def test_a_delete_during_a_tick_is_not_undone_and_the_next_tick_deletes(world: World) -> None:
    active = await world.roll_out()

    def api_deletes(url: str) -> None:
        world.serve.on_applications = None
        world.store.mark_deleting(NAME)

    world.serve.on_applications = api_deletes
    world.serve.set_status("DEPLOY_FAILED", "replica crashed")
    world.clock.advance(1)
    await world.tick()
    service = world.service()
    assert service.deleting and service.unhealthy_since is None

    world.clock.advance(1)
    await world.tick()
    assert world.dataplane.removed == [NAME]
    await world.background_settled()
    assert world.clusters() == []
    assert "ClusterDeleted" in world.reasons()
    world.clock.advance(1)
    assert await world.tick() is None
    assert world.store.get_service(NAME) is None
    assert ("stop", active.name) in world.provider.calls


# -- background starts and stops ------------------------------------------------------------


async def test_a_node_start_failing_on_a_serving_cluster_is_an_event_not_a_failure(world: World) -> None:
    # The executor decides by the cluster's role as stored when the start ends, for every provider:
    # a serving cluster stays (one node short) and the next tick tries again.
    world.provider.workers_gate = asyncio.Event()
    world.provider.start_workers_error = RuntimeError("no memory for the raylet")
    world.apply(make_spec(workers=1))
    await world.tick()
    pending = world.only(ClusterRole.PENDING)
    world.store.update_cluster(pending.name, role=ClusterRole.ACTIVE)  # it became the serving cluster meanwhile
    world.provider.release_workers()
    await world.controller.executor.background[pending.name]
    await world.background_settled()
    assert world.cluster(pending.name).failure_reason is None
    started = [e for e in world.events() if e.reason == "NodeStartFailed"]
    assert len(started) == 1
    assert started[0].message.startswith(f"{pending.name}: no memory for the raylet; trying again")
    assert started[0].type == "Warning"


@pytest.mark.parametrize(("autoscaled", "restarts", "unhealthy"), [(True, 0, False), (True, 1, True), (False, 0, True)])
async def test_a_node_being_added_leaves_the_cluster_healthy_one_being_started_again_does_not(
    world: World, autoscaled: bool, restarts: int, unhealthy: bool
) -> None:
    """A worker with no pid on a serving cluster: one Ray's autoscaler asked for (never started)
    is capacity on its way, not a missing node; one that exited and is started again is missing,
    as is a fixed cluster's worker that never ran."""
    spec = make_spec(workers=1)
    if autoscaled:
        config = spec.spec.rayClusterConfig
        group = config.workerGroups[0].model_copy(update={"minReplicas": 0, "maxReplicas": 3})
        config = config.model_copy(update={"enableInTreeAutoscaling": True, "workerGroups": [group]})
        spec = spec.model_copy(update={"spec": spec.spec.model_copy(update={"rayClusterConfig": config})})
    active = await world.roll_out(spec)
    nodes = nodes_of(world.cluster(active.name))
    added = replace(nodes[1], pid=None, session_id=None, node_id=2, restarts=restarts)
    world.store.update_cluster(active.name, nodes=(*nodes, added))
    world.provider.workers_gate = asyncio.Event()  # its start is under way for the whole look
    before = len(world.reasons())
    world.clock.advance(1)
    await world.tick()
    assert ("ClusterUnhealthy" in world.reasons()[before:]) is unhealthy, world.reasons()
    assert ("ReadyChanged" in world.reasons()[before:]) is unhealthy, "Ready stays True while a node is added"
    world.provider.release_workers()
    await world.background_settled()


async def test_a_worker_start_raising_fails_the_cluster_and_the_task_is_pruned(world: World) -> None:
    world.provider.workers_gate = asyncio.Event()
    world.provider.start_workers_error = RuntimeError("no memory for the raylet")
    world.apply(make_spec(workers=1))
    await world.tick()
    pending = world.only(ClusterRole.PENDING)
    task = world.controller.executor.background[pending.name]
    assert task.get_name() == f"start-{pending.name}"
    world.provider.release_workers()
    await task
    await world.background_settled()
    assert pending.name not in world.controller.executor.background
    assert world.cluster(pending.name).failure_reason == "StartFailed: no memory for the raylet"

    world.clock.advance(1)
    await world.tick()
    failed = [e for e in world.events() if e.reason == "RolloutFailed"]
    assert failed and failed[-1].type == "Warning" and "no memory for the raylet" in failed[-1].message
    assert world.service().failed_generation == 1


async def test_workers_started_in_the_background_are_recorded_as_they_spawn(world: World) -> None:
    world.provider.workers_gate = asyncio.Event()
    world.apply(make_spec(workers=2))
    await world.tick()
    pending = world.only(ClusterRole.PENDING)
    assert pending.worker_pids == ()
    world.clock.advance(1)
    await world.tick()  # still starting: the next tick does not start it twice
    assert world.provider.calls.count(("start_nodes", pending.name)) == 1
    world.provider.release_workers()
    await world.background_settled()
    assert len(world.cluster(pending.name).worker_pids) == 2


async def test_a_stop_that_raises_is_a_warning_event_and_is_pruned(world: World) -> None:
    active = await world.roll_out()
    world.provider.stop_error = RuntimeError("kill failed")
    world.store.mark_deleting(NAME)
    world.clock.advance(1)
    await world.tick()
    await world.background_settled()
    [failure] = [e for e in world.events() if e.reason == "BackgroundTaskFailed"]
    assert failure.type == "Warning"
    assert failure.message == f"stop-{active.name}: RuntimeError: kill failed"
    assert world.cluster(active.name).role == ClusterRole.DELETING

    world.provider.stop_error = None
    world.clock.advance(1)
    await world.tick()  # deletion resumed
    await world.background_settled()
    assert world.clusters() == []


async def test_a_stop_that_leaves_pids_is_retried(world: World) -> None:
    active = await world.roll_out()
    world.provider.leftovers[active.name] = [4242]
    world.store.mark_deleting(NAME)
    world.clock.advance(1)
    await world.tick()
    await world.background_settled()
    incomplete = [e for e in world.events() if e.reason == "ClusterStopIncomplete"]
    assert incomplete and "4242" in incomplete[-1].message
    assert world.cluster(active.name).role == ClusterRole.DELETING

    world.provider.leftovers.clear()
    world.clock.advance(1)
    await world.tick()
    await world.background_settled()
    assert world.clusters() == []
    assert world.provider.calls.count(("stop", active.name)) == 2


async def test_shutdown_waits_for_background_starts(world: World) -> None:
    world.provider.workers_gate = asyncio.Event()
    world.apply(make_spec(workers=1))
    await world.tick()
    pending = world.only(ClusterRole.PENDING)
    shutdown = asyncio.create_task(world.controller.shutdown(stop_clusters=False))
    await asyncio.sleep(0.05)
    assert not shutdown.done()
    world.provider.release_workers()
    await asyncio.wait_for(shutdown, 5)
    assert len(world.cluster(pending.name).worker_pids) == 1
    assert world.controller.executor.background == {}


async def test_shutdown_with_stop_clusters_cancels_starts_and_stops_every_cluster(world: World) -> None:
    world.provider.workers_gate = asyncio.Event()  # never released: the start hangs
    world.apply(make_spec(workers=1))
    await world.tick()
    pending = world.only(ClusterRole.PENDING)
    task = world.controller.executor.background[pending.name]
    await asyncio.wait_for(world.controller.shutdown(stop_clusters=True), 5)
    assert task.cancelled()
    assert ("stop", pending.name) in world.provider.calls
    assert world.store.list_clusters() == []


# -- the data plane switch------------------------------------------------------------------


async def fail_the_first_switch(world: World) -> ClusterRecord:
    """First apply up to the switch, whose set_route the data plane refuses."""
    world.apply(make_spec())
    await world.tick()
    world.clock.advance(1)
    await world.tick()
    pending = world.only(ClusterRole.PENDING)
    world.serve.set_status("RUNNING")
    world.dataplane.fail("set_route")
    world.clock.advance(1)
    await world.tick()
    return pending


async def test_a_failed_switch_changes_no_role_and_the_next_tick_switches(world: World) -> None:
    pending = await fail_the_first_switch(world)
    assert world.only(ClusterRole.PENDING).name == pending.name  # nothing after the switch ran
    assert world.dataplane.table == {}
    route_failed = world.events()[-1]
    assert (route_failed.reason, route_failed.type) == ("RouteFailed", "Warning")
    assert "envoy not answering" in route_failed.message
    for _ in range(3):  # the same refusal again: told once, not at every tick
        world.clock.advance(1)
        await world.tick()
    assert world.reasons().count("RouteFailed") == 1

    world.dataplane.recover()
    world.clock.advance(1)
    await world.tick()
    assert world.only(ClusterRole.ACTIVE).name == pending.name
    assert world.dataplane.table[NAME].weights == {pending.name: 100}
    assert world.ready() is True and world.service().observed_generation == 1


async def test_a_failed_switch_does_not_report_the_service_ready_or_switched(world: World) -> None:
    # The tick stopped at the switch, but the planner's projected status (the pending cluster
    # promoted) and its events were persisted as if every action had run.
    await fail_the_first_switch(world)
    for _ in range(2):
        # No route exists and the cluster is still pending: nothing serves the service yet.
        assert world.ready() is not True
        assert world.service().observed_generation == 0
        assert "TrafficSwitched" not in world.reasons()
        world.clock.advance(1)
        await world.tick()


async def test_a_moved_listener_is_routed_again(world: World) -> None:
    active = await world.roll_out()
    world.apply(make_spec(ingress={"port": 8001}))
    world.clock.advance(1)
    await world.tick()
    assert world.dataplane.set_calls[-1].port == 8001
    assert world.dataplane.set_calls[-1].weights == {active.name: 100}
    calls = len(world.dataplane.set_calls)
    world.clock.advance(1)
    await world.tick()
    assert len(world.dataplane.set_calls) == calls  # in place now: not set again
    assert world.service().observed_generation == 2


async def test_an_unreadable_data_plane_is_observed_as_such_and_no_role_changes(world: World) -> None:
    active = await world.roll_out()
    world.dataplane.fail("routes")
    world.dataplane.fail("set_route")
    world.clock.advance(1)
    await world.tick()
    assert world.only(ClusterRole.ACTIVE).name == active.name
    observation = world.controller.status_snapshot(NAME)
    assert observation is not None and not observation.ingress_ok and observation.route is None


# -- fault hooks ----------------------------------------------------------------------------


class RecordingHooks(Hooks):
    def __init__(self) -> None:
        self.points: list[tuple[str, int]] = []

    def reached(self, point: str, cluster: ClusterRecord | None = None, service_generation: int = 0) -> None:
        self.points.append((point, max(service_generation, cluster.generation if cluster else 0)))


async def upgrade_to_draining(world: World) -> None:
    """Roll out generation 1, then a new cluster for generation 2 until the old one drains."""
    await world.roll_out()
    world.apply(make_spec(cpus=2))
    for _ in range(3):  # create, PUT, applied (DEPLOYING)
        world.clock.advance(1)
        await world.tick()
        await world.background_settled()
    world.serve.set_status("RUNNING")
    world.clock.advance(1)
    await world.tick()  # switch
    world.clock.advance(1)
    await world.tick()  # draining


async def test_hooks_see_every_point_of_an_upgrade_in_order(world: World) -> None:
    hooks = RecordingHooks()
    world.controller.hooks = hooks
    await upgrade_to_draining(world)
    assert world.clusters(ClusterRole.DRAINING)
    assert [point for point, generation in hooks.points if generation == 2] == [
        "cluster-intent-written",
        "pending-started",
        "config-audited",
        "config-submitted",
        "route-switched",
    ]


@pytest.mark.parametrize(
    "point",
    # "deleting-old" is reached in the provider, between its SIGTERM and SIGKILL.
    [pytest.param(point, id=point) for point in CRASH_POINTS if point != "deleting-old"],
)
async def test_injected_faults_kill_at_their_point_of_the_second_rollout_only(world: World, point: str) -> None:
    kills: list[tuple[str, int]] = []

    def kill() -> None:
        kills.append((point, world.service().generation))

    world.controller.hooks = InjectedFaults(point, kill=kill)
    await upgrade_to_draining(world)
    assert kills and set(kills) == {(point, 2)}


async def test_injected_put_failures_are_retried_like_a_503(world: World) -> None:
    world.controller.hooks = InjectedFaults(None, fail_puts=1)
    await world.roll_out()  # generation 1 is never failed
    assert len(world.serve.puts) == 1
    world.apply(make_spec(msg="v2"))
    world.clock.advance(1)
    await world.tick()
    assert world.reasons()[-1] == "ConfigSubmitRetry"
    assert len(world.serve.puts) == 1
    world.clock.advance(1)
    await world.tick()
    assert len(world.serve.puts) == 2


def test_hooks_from_the_environment() -> None:
    assert type(hooks_from_environment({})) is Hooks
    assert type(hooks_from_environment({CRASH_ENV: "", FAIL_PUTS_ENV: "0"})) is Hooks
    injected = hooks_from_environment({CRASH_ENV: "config-audited", FAIL_PUTS_ENV: "2"})
    assert isinstance(injected, InjectedFaults)
    assert (injected.crash_at, injected.fail_puts) == ("config-audited", 2)
    with pytest.raises(ValueError, match="unknown crash point 'nowhere'"):
        hooks_from_environment({CRASH_ENV: "nowhere"})
    with pytest.raises(ValueError, match="unknown crash point"):
        InjectedFaults("nowhere")
    kills: list[str] = []
    # a node added to a running cluster is a crash point in generation 1 too; a rollout's are not
    InjectedFaults("node-spawned", kill=lambda: kills.append("node-spawned")).reached("node-spawned")
    InjectedFaults("pending-started", kill=lambda: kills.append("pending-started")).reached("pending-started")
    assert kills == ["node-spawned"]


# -- the loops: waits and timeouts (asyncio.TimeoutError is not TimeoutError on 3.10) -------


@pytest.fixture
def fast_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(controller_module, "SERVICE_SCAN_SECONDS", 0.02)
    for constant in ("PENDING_TICK_SECONDS", "FAST_TICK_SECONDS", "STEADY_TICK_SECONDS"):
        monkeypatch.setattr(controller_module, constant, 0.02)


def count_ticks(world: World) -> list[str]:
    ticks: list[str] = []
    real_tick = world.controller.tick

    async def counted(name: str) -> float | None:
        ticks.append(name)
        return await real_tick(name)

    world.controller.tick = counted  # type: ignore[method-assign]
    return ticks


async def test_run_survives_its_scan_timeouts_and_exits_promptly_on_stop(world: World, fast_loops: None) -> None:
    ticks = count_ticks(world)
    world.apply(make_spec())
    stop = asyncio.Event()
    runner = asyncio.create_task(world.controller.run(stop))
    # Several scan timeouts and tick delays (0.02 s each): waited for, not slept, so that a
    # loaded machine (the unit tests share both cores) only makes it slower.
    deadline = time.monotonic() + 10
    while len(ticks) < 3 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert not runner.done()
    assert len(ticks) >= 3  # the service loop ticks again after each wait times out
    assert world.controller.debug_state()["services"] == [NAME]
    started = time.monotonic()
    stop.set()
    await asyncio.wait_for(runner, 2)
    assert time.monotonic() - started < 0.8  # under the 1 s scan period: at once, give or take a busy core


async def test_run_exits_promptly_on_stop_with_the_real_scan_period(world: World) -> None:
    stop = asyncio.Event()
    runner = asyncio.create_task(world.controller.run(stop))
    await asyncio.sleep(0.01)
    started = time.monotonic()
    stop.set()
    await asyncio.wait_for(runner, 2)
    assert time.monotonic() - started < 0.8  # under the 1 s scan period: at once, give or take a busy core


async def test_the_service_loop_waits_its_delay_and_wakes_on_wake(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    for constant in ("PENDING_TICK_SECONDS", "FAST_TICK_SECONDS", "STEADY_TICK_SECONDS"):
        monkeypatch.setattr(controller_module, constant, 30.0)
    ticks = count_ticks(world)
    world.apply(make_spec())
    loop = asyncio.create_task(world.controller._guarded_service_loop(NAME))
    try:
        await asyncio.sleep(0.05)
        assert len(ticks) == 1  # waiting its 30 s
        world.controller.wake(NAME)
        await asyncio.sleep(0.05)
        assert len(ticks) == 2
        world.controller.wake("unknown-service")  # harmless
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop


async def test_the_service_loop_retries_after_a_failed_tick_and_ends_when_the_service_is_gone(
    world: World, fast_loops: None
) -> None:
    ticks = count_ticks(world)
    world.apply(make_spec())
    world.dataplane.fail("routes", ValueError("an unexpected bug"))  # not an IngressError: the tick raises
    loop = asyncio.create_task(world.controller._guarded_service_loop(NAME))
    await asyncio.sleep(0.15)
    assert not loop.done() and len(ticks) >= 2
    world.store.delete_service_row(NAME)
    await asyncio.wait_for(loop, 1)
    assert NAME not in world.controller._wakeups


async def test_a_data_plane_error_in_observe_is_not_a_failed_tick(world: World) -> None:
    world.apply(make_spec())
    world.dataplane.fail("routes", DataPlaneError("envoy admin: connection refused"))
    assert await world.tick() == PENDING_TICK_SECONDS


# -- found in review: removals, a delete raced by an apply, a restore that cannot run ----------


async def test_an_in_place_change_that_removes_an_argument_is_sent_and_observed(world: World) -> None:
    """A subset check of Ray's answer would call the old config (which has the key) deployed."""
    extra = make_spec(serveConfig={"applications": [_app(msg="v1", debug=True)]})
    active = await world.roll_out(extra)
    world.apply(make_spec())  # the same app without `debug`
    await world.tick()
    assert world.serve.puts[-1][1]["applications"][0]["args"] == {"msg": "v1"}
    world.serve.set_status("RUNNING")
    world.clock.advance(1)
    await world.tick()
    assert world.service().observed_generation == 2
    assert world.cluster(active.name).applied_config_hash != active.applied_config_hash


async def test_an_in_place_change_that_removes_an_app_waits_until_ray_deleted_it(world: World) -> None:
    two = make_spec(serveConfig={"applications": [_app(msg="v1"), _app(name="b", route_prefix="/b")]})
    await world.roll_out(two)
    world.apply(make_spec())
    # Ray still runs app "b" (the PUT is acknowledged but not applied yet): not rolled out.
    world.serve.defer = True
    await world.tick()
    world.clock.advance(1)
    await world.tick()
    assert world.service().observed_generation == 1
    world.serve.deploy_deferred("RUNNING")
    world.clock.advance(1)
    await world.tick()
    assert world.service().observed_generation == 2


async def test_an_apply_stored_while_the_service_is_being_forgotten_survives(world: World) -> None:
    await world.roll_out()
    world.store.mark_deleting(NAME)
    while world.clusters():
        world.clock.advance(1)
        await world.tick()
        await world.background_settled()
    assert world.store.get_service(NAME) is not None, "the next tick forgets it"

    async def api_applies() -> dict[str, Any]:
        world.dataplane.on_routes = None
        world.apply(make_spec(msg="v9"))  # the API stores a new spec mid-tick
        return {}

    world.dataplane.on_routes = api_applies
    world.clock.advance(1)
    await world.tick()
    service = world.store.get_service(NAME)
    assert service is not None and not service.deleting, "the apply was lost with the deleted row"


async def test_a_failed_in_place_change_is_stored_even_when_its_restore_cannot_run(world: World) -> None:
    active = await world.roll_out()
    with world.store.transaction() as tx:  # a store from before documents were kept
        tx.execute("UPDATE submissions SET document_json = NULL")
    world.controller.documents.cache.clear()
    world.apply(make_spec(msg="broken"))
    await world.tick()
    world.serve.set_status("DEPLOY_FAILED", "constructor raised")
    for _ in range(3):
        world.clock.advance(1)
        await world.tick()
    service = world.service()
    assert service.failed_generation == 2 and service.observed_generation == 2
    assert world.reasons().count("RestoreImpossible") == 1, "tried once, not every tick"
    assert world.clusters() == [world.cluster(active.name)]


async def test_the_failure_is_stored_before_the_restore_put(world: World) -> None:
    """A crash right after the restore PUT must not make the next controller re-send the broken config."""
    await world.roll_out()
    world.apply(make_spec(msg="broken"))
    await world.tick()
    world.serve.set_status("DEPLOY_FAILED", "constructor raised")
    seen: list[int | None] = []
    world.serve.on_put = lambda url, document: seen.append(world.service().failed_generation)
    world.clock.advance(1)
    await world.tick()
    assert seen == [2], "the restore PUT went out before the failure was stored"


def _app(name: str = "hello", route_prefix: str = "/", **args: Any) -> dict[str, Any]:
    return {"name": name, "route_prefix": route_prefix, "import_path": "hello:app", "args": args}


async def test_a_forgotten_service_prunes_environments_and_a_prune_asked_meanwhile_follows(world: World) -> None:
    """Its last cluster went before its row did: environments are pruned once the row goes too,
    beside the ticks; a prune asked for while one runs runs after it (it read the store later)."""
    executor = world.controller.executor
    gate, seen = asyncio.Event(), []
    gate.set()  # (the prune at the cluster's deletion runs in its stop task: not held)

    async def prune() -> None:
        seen.append(world.store.get_service(NAME) is None)
        await gate.wait()

    executor.environment_builds.prune = prune  # type: ignore[method-assign]
    await world.roll_out()
    world.store.mark_deleting(NAME)
    while world.store.get_service(NAME) is not None:
        world.clock.advance(1)
        await world.tick()
        await world.background_settled()
    assert executor.pruning is not None
    await executor.pruning
    assert seen[-1] is True and seen.count(True) == 1, "pruned once more, after the service's row was gone"
    gate.clear()
    executor._prune_soon()
    await asyncio.sleep(0)
    executor._prune_soon()  # two more asked for while one is held: one prune follows it
    executor._prune_soon()
    gate.set()
    await executor.pruning
    assert seen.count(True) == 3
