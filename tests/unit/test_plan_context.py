"""The planner's seam: PlanContext and the step modules, called directly on one context.

test_planner.py and test_canary.py drive whole ticks through plan(); here a single step runs
on a context built by hand, and the test reads the actions, events and planned view it left."""

from __future__ import annotations

from typing import Any

from servekeeper.core import actions as act
from servekeeper.core.health import Verdict
from servekeeper.core.planner import PlanContext, plan, run
from servekeeper.core.planner.active import track_health
from servekeeper.core.planner.traffic import MIN_DRAIN_SECONDS, desired_route, drain, retire, switch_all_traffic
from servekeeper.core.planner.workers import MAX_WORKER_RESTARTS, restart_workers
from servekeeper.model.enums import ClusterRole
from servekeeper.model.observation import ClusterObservation, IngressRouteObservation, Observation
from servekeeper.model.records import ClusterPorts, ClusterRecord, NodePlacement, NodePorts, ServiceRecord
from servekeeper.model.spec import ServiceSpec
from tests.unit.test_planner import make_spec

NOW = 1000.0
NODE_PORTS = NodePorts(
    node_manager=1,
    object_manager=2,
    metrics_export=3,
    agent_listen=4,
    agent_grpc=5,
    runtime_env_agent=6,
    min_worker=10,
    max_worker=20,
)
PORTS = ClusterPorts(gcs=1, dashboard=2, client_server=3, serve_http=4, serve_grpc=5, node_ports=(NODE_PORTS,))


def cluster(spec: ServiceSpec, name: str, role: ClusterRole, **changes: Any) -> ClusterRecord:
    record = ClusterRecord(
        name=name,
        service=spec.name,
        generation=1,
        cluster_spec_hash=spec.cluster_spec_hash(),
        cluster_spec_json=spec.spec.rayClusterConfig.model_dump_json(),
        role=role,
        ports=PORTS,
        temp_dir=f"/sim/{name}",
        log_dir=f"/sim/{name}",
        created_at=NOW - 100,
        head_pid=1,
    )
    return record.with_changes(**changes)


def context(
    clusters: list[ClusterRecord],
    route: IngressRouteObservation | None = None,
    spec: ServiceSpec | None = None,
) -> PlanContext:
    spec = spec or make_spec()
    service = ServiceRecord(name=spec.name, spec_json=spec.to_json(), generation=1, created_at=NOW - 200)
    observed = {c.name: ClusterObservation(name=c.name, processes_alive=True) for c in clusters}
    return PlanContext(spec, service, clusters, Observation(clusters=observed, route=route), NOW)


def test_recording_methods_change_the_planned_view_with_each_action() -> None:
    spec = make_spec()
    old = cluster(spec, "svc-1", ClusterRole.ACTIVE, created_at=NOW - 100)
    new = cluster(spec, "svc-2", ClusterRole.ACTIVE, created_at=NOW - 50)
    ctx = context([new, old])
    assert ctx.clusters_with_role(ClusterRole.ACTIVE) == [old, new], "oldest first"
    assert ctx.newest(ClusterRole.ACTIVE) == new
    assert ctx.observed(cluster(spec, "svc-9", ClusterRole.PENDING)).error == "not observed"

    updated = ctx.update_cluster(old, role=ClusterRole.DRAINING, drain_started_at=NOW)
    ctx.delete_cluster(new, "Test")
    ctx.create_cluster(ClusterRole.PENDING, "Test")
    ctx.event("Tested", "a message", warning=True)
    assert ctx.plan.actions == [
        act.UpdateCluster("svc-1", {"role": ClusterRole.DRAINING, "drain_started_at": NOW}),
        act.DeleteCluster("svc-2", "Test"),
        act.CreateCluster(role=ClusterRole.PENDING, reason="Test"),
    ]
    assert ctx.clusters["svc-1"] == updated and updated.role == ClusterRole.DRAINING
    assert ctx.clusters["svc-2"].role == ClusterRole.DELETING
    assert ctx.newest(ClusterRole.ACTIVE) is None
    assert ctx.planned(act.CreateCluster) == [act.CreateCluster(role=ClusterRole.PENDING, reason="Test")]
    assert [(e.reason, e.type) for e in ctx.plan.events] == [("ClusterCreating", "Normal"), ("Tested", "Warning")]
    assert all(e.time == NOW and e.service == spec.name for e in ctx.plan.events)


def test_switch_all_traffic_routes_then_promotes_and_drains_the_old_active() -> None:
    spec = make_spec()
    active = cluster(spec, "svc-1", ClusterRole.ACTIVE, ready_at=NOW - 90)
    pending = cluster(spec, "svc-2", ClusterRole.PENDING)
    ctx = context([active, pending])
    ctx.update_service(unhealthy_since=NOW - 5)

    switch_all_traffic(ctx, pending)

    assert ctx.plan.actions == [
        act.SetRoute(active="svc-2", upstreams=("svc-2", "svc-1")),
        act.UpdateCluster("svc-1", {"role": ClusterRole.DRAINING, "drain_started_at": NOW}),
        act.UpdateCluster("svc-2", {"role": ClusterRole.ACTIVE, "ready_at": NOW}),
    ]
    assert ctx.newest(ClusterRole.ACTIVE) == pending.with_changes(role=ClusterRole.ACTIVE, ready_at=NOW)
    assert ctx.plan.service.unhealthy_since is None
    assert [e.reason for e in ctx.plan.events] == ["TrafficSwitched"]
    # The route the roles now want agrees with the switch.
    assert desired_route(ctx) == act.SetRoute(active="svc-2", upstreams=("svc-2", "svc-1"))


def test_retire_deletes_an_unrouted_pending_cluster_and_drains_a_routed_one() -> None:
    spec = make_spec()
    active = cluster(spec, "svc-1", ClusterRole.ACTIVE)
    pending = cluster(spec, "svc-2", ClusterRole.PENDING)
    ctx = context([active, pending])
    retire(ctx, pending, "SpecChanged")
    assert ctx.plan.actions == [act.DeleteCluster("svc-2", "SpecChanged")]

    preview_route = IngressRouteObservation(active="svc-1", upstreams=frozenset({"svc-1", "svc-2"}))
    ctx = context([active, pending], route=preview_route)
    retire(ctx, pending, "SpecChanged")
    assert ctx.plan.actions == [
        act.SetRoute(active="svc-1", upstreams=("svc-1", "svc-2")),  # at weight 0, still counted
        act.UpdateCluster("svc-2", {"role": ClusterRole.DRAINING, "drain_started_at": NOW, "canary": None}),
    ]


def test_drain_takes_an_idle_cluster_out_of_the_route_before_deleting_it() -> None:
    spec = make_spec()
    active = cluster(spec, "svc-2", ClusterRole.ACTIVE)
    idle = cluster(spec, "svc-1", ClusterRole.DRAINING, drain_started_at=NOW - MIN_DRAIN_SECONDS)
    busy = cluster(spec, "svc-0", ClusterRole.DRAINING, drain_started_at=NOW - MIN_DRAIN_SECONDS)
    route = IngressRouteObservation(
        active="svc-2", upstreams=frozenset({"svc-0", "svc-1", "svc-2"}), inflight={"svc-0": 3, "svc-1": 0}
    )
    ctx = context([active, idle, busy], route=route)

    drain(ctx)

    assert ctx.plan.actions == [
        act.SetRoute(active="svc-2", upstreams=("svc-2", "svc-0")),
        act.DeleteCluster("svc-1", "Drained"),
    ]
    assert [e.reason for e in ctx.plan.events] == ["ClusterDrained"]
    assert ctx.clusters["svc-0"].role == ClusterRole.DRAINING


def test_restart_workers_counts_each_restart_and_stops_at_the_limit() -> None:
    spec = make_spec()

    def worker(pid: int, restarts: int) -> NodePlacement:
        return NodePlacement(
            host="h1",
            address="10.0.0.1",
            role="worker",
            ports=NODE_PORTS,
            temp_dir="/tmp/w",
            pid=pid,
            restarts=restarts,
        )

    nodes = (worker(11, 0), worker(12, MAX_WORKER_RESTARTS))
    active = cluster(spec, "svc-1", ClusterRole.ACTIVE, nodes=nodes, worker_pids=(11, 12))
    ctx = context([active])

    updated = restart_workers(ctx, active, exited=(11, 12))

    assert ctx.plan.actions == [act.RestartNodes("svc-1", (11,))]
    assert updated.worker_pids == (12,)
    assert [(n.pid, n.restarts) for n in updated.nodes] == [(None, 1), (12, MAX_WORKER_RESTARTS)]
    assert ctx.clusters["svc-1"] == updated
    assert [e.reason for e in ctx.plan.events] == ["WorkerRestarting"]


def test_track_health_records_only_the_changes() -> None:
    ctx = context([])
    track_health(ctx, Verdict(False, "AppUnhealthy", "hello is UNHEALTHY"))
    track_health(ctx, Verdict(False, "AppUnhealthy", "hello is UNHEALTHY"))
    assert ctx.plan.service.unhealthy_since == NOW
    track_health(ctx, Verdict(True, "Healthy", ""))
    assert ctx.plan.service.unhealthy_since is None
    assert [e.reason for e in ctx.plan.events] == ["ClusterUnhealthy", "ClusterHealthy"]


def test_run_on_a_context_is_plan() -> None:
    spec = make_spec()
    clusters = [cluster(spec, "svc-1", ClusterRole.ACTIVE)]
    ctx = context(clusters, spec=spec)
    assert run(ctx) == plan(spec, ctx.service, clusters, ctx.observation, NOW)
