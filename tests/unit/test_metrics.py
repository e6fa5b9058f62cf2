"""Prometheus metrics: the controller's counters and the state collector, over a real store, a
real Controller and fakes of Ray, the provider, the data plane and the clock."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from servekeeper.api.app import build_app
from servekeeper.api.metrics import add_metrics_route, build_metrics_app
from servekeeper.controller.loop import Controller
from servekeeper.controller.metrics import ControllerMetrics, Metrics, applied_at, record_applied
from servekeeper.daemon import JsonLogFormatter, configure_logging
from servekeeper.dataplane import BackendStats, DataPlaneError, RouteObservation
from servekeeper.model.enums import ClusterRole
from servekeeper.model.records import NodePlacement, NodePorts
from servekeeper.model.spec import ServiceSpec, parse_spec
from servekeeper.store.store import Store
from tests.unit.fakes import FakeClock, FakeDataPlane, FakeProvider, FakeServe

NAME = "svc"


def make_spec(cpus: float = 1, **more: Any) -> ServiceSpec:
    body: dict[str, Any] = {
        "ingress": {"port": 8000},
        "rayClusterConfig": {"head": {"numCpus": cpus}},
        "serveConfig": {"applications": [{"name": "hello", "route_prefix": "/", "import_path": "hello:app"}]},
        "readinessTimeoutSeconds": 120,
        **more,
    }
    document = {"apiVersion": "servekeeper/v1alpha1", "kind": "RayService", "metadata": {"name": NAME}, "spec": body}
    return parse_spec(document)


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


@dataclass
class World:
    store: Store
    serve: FakeServe
    dataplane: FakeDataPlane
    clock: FakeClock
    controller: Controller
    counters: ControllerMetrics
    stats: dict[str, BackendStats] = field(default_factory=dict)
    stats_error: Exception | None = None

    def apply(self, spec: ServiceSpec) -> None:
        # What the API does: the spec and its apply time in one transaction.
        with self.store.transaction():
            service, changed = self.store.apply_spec(spec.name, spec.to_json(), self.clock())
            if changed:
                record_applied(self.store, service.name, service.generation, self.clock())

    async def tick(self, seconds: float = 1) -> None:
        self.clock.advance(seconds)
        await self.controller.tick(NAME)
        for _ in range(200):  # cluster starts run in the background
            if not self.controller.executor.background:
                break
            await asyncio.sleep(0.005)

    async def backend_stats(self) -> Mapping[str, BackendStats]:
        if self.stats_error is not None:
            raise self.stats_error
        return dict(self.stats)

    async def routes(self) -> Mapping[str, RouteObservation]:
        if self.stats_error is not None:
            raise self.stats_error
        return await self.dataplane.routes()

    async def scrape(self) -> Samples:
        metrics = Metrics(self.store, self.counters, self.controller.status_snapshot, self.routes, self.backend_stats)
        return parse((await metrics.render()).decode())

    def active(self) -> str:
        [cluster] = [c for c in self.store.list_clusters(NAME) if c.role == ClusterRole.ACTIVE]
        return cluster.name

    async def roll_out(self, spec: ServiceSpec) -> None:
        self.apply(spec)
        await self.tick()  # pending cluster created
        await self.tick()  # config PUT
        await self.tick()  # Ray shows it DEPLOYING
        self.serve.set_status("RUNNING")
        await self.tick()  # switch


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    store = Store(tmp_path / "store.db")
    session = aiohttp.ClientSession()
    provider, serve, dataplane, clock = FakeProvider(), FakeServe(), FakeDataPlane(), FakeClock()
    counters = ControllerMetrics()
    controller = Controller(
        store,
        provider,
        dataplane,
        session,
        tmp_path,
        clock=clock,
        serve=serve,
        metrics=counters,  # type: ignore[arg-type]
    )
    try:
        yield World(store, serve, dataplane, clock, controller, counters)
    finally:
        provider.release_workers()
        await controller.shutdown(stop_clusters=False)
        await session.close()
        store.close()


async def test_a_first_rollout_shows_in_every_series(world: World) -> None:
    world.apply(make_spec())
    await world.tick()
    samples = await world.scrape()
    assert value(samples, "servekeeper_service_generation", service=NAME) == 1
    assert value(samples, "servekeeper_service_observed_generation", service=NAME) == 0
    assert value(samples, "servekeeper_service_condition", service=NAME, type="Ready") == 0
    assert value(samples, "servekeeper_service_condition", service=NAME, type="UpgradeInProgress") == 1
    assert value(samples, "servekeeper_rollouts_total", service=NAME, result="succeeded") == 0
    [pending] = world.store.list_clusters(NAME)
    assert value(samples, "servekeeper_cluster_traffic_ratio", service=NAME, cluster=pending.name, role="pending") == 0

    await world.tick()
    await world.tick()
    world.serve.set_status("RUNNING")
    world.stats = {
        pending.name: BackendStats(
            pending.name,
            rq_total=12,
            rq_2xx=10,
            rq_4xx=1,
            rq_5xx=1,
            rq_active=3,
            latency_ms_buckets={0.5: 1, 25.0: 9, 3600000.0: 12},
        )
    }
    await world.tick()
    samples = await world.scrape()
    assert value(samples, "servekeeper_service_condition", service=NAME, type="Ready") == 1
    assert value(samples, "servekeeper_service_condition", service=NAME, type="UpgradeInProgress") == 0
    assert value(samples, "servekeeper_service_observed_generation", service=NAME) == 1
    assert value(samples, "servekeeper_cluster_traffic_ratio", service=NAME, cluster=pending.name, role="active") == 1
    assert value(samples, "servekeeper_cluster_inflight_requests", service=NAME, cluster=pending.name) == 3
    for code_class, count in (("2xx", 10), ("4xx", 1), ("5xx", 1)):
        labels = {"service": NAME, "cluster": pending.name, "code_class": code_class}
        assert value(samples, "servekeeper_ingress_requests_total", **labels) == count
    latency = "servekeeper_ingress_request_duration_seconds_bucket"
    assert value(samples, latency, service=NAME, cluster=pending.name, le="0.0005") == 1
    assert value(samples, latency, service=NAME, cluster=pending.name, le="0.025") == 9
    assert value(samples, latency, service=NAME, cluster=pending.name, le="+Inf") == 12
    assert value(samples, "servekeeper_rollouts_total", service=NAME, result="succeeded") == 1
    # applied at t0, switched 4 fake seconds later
    assert value(samples, "servekeeper_rollout_duration_seconds_count", service=NAME) == 1
    assert value(samples, "servekeeper_rollout_duration_seconds_sum", service=NAME) == 4
    assert value(samples, "servekeeper_config_submissions_total", service=NAME) == 1
    assert value(samples, "servekeeper_dataplane_stats_up") == 1

    await world.tick()  # a steady tick counts nothing again
    again = await world.scrape()
    assert value(again, "servekeeper_rollouts_total", service=NAME, result="succeeded") == 1
    assert value(again, "servekeeper_rollout_duration_seconds_count", service=NAME) == 1


async def test_an_upgrade_moves_traffic_and_role_series(world: World) -> None:
    await world.roll_out(make_spec())
    old = world.active()
    world.apply(make_spec(cpus=2))
    await world.tick()
    await world.tick()
    await world.tick()
    pending = next(c.name for c in world.store.list_clusters(NAME) if c.role == ClusterRole.PENDING)
    world.dataplane.inflight = {old: 5}
    samples = await world.scrape()
    assert value(samples, "servekeeper_cluster_traffic_ratio", service=NAME, cluster=old, role="active") == 1
    assert value(samples, "servekeeper_cluster_traffic_ratio", service=NAME, cluster=pending, role="pending") == 0
    world.serve.set_status("RUNNING")
    await world.tick()
    world.stats_error = DataPlaneError("envoy not answering")  # then the controller's last look counts
    await world.tick()
    samples = await world.scrape()
    assert value(samples, "servekeeper_dataplane_stats_up") == 0
    assert value(samples, "servekeeper_cluster_traffic_ratio", service=NAME, cluster=pending, role="active") == 1
    assert value(samples, "servekeeper_cluster_traffic_ratio", service=NAME, cluster=old, role="draining") == 0
    assert value(samples, "servekeeper_cluster_inflight_requests", service=NAME, cluster=old) == 5
    assert value(samples, "servekeeper_rollouts_total", service=NAME, result="succeeded") == 2
    assert value(samples, "servekeeper_service_generation", service=NAME) == 2


async def test_node_restarts_are_counted_by_role_from_the_record(world: World) -> None:
    await world.roll_out(make_spec())
    active = world.active()
    ports = NodePorts(1, 2, 3, 4, 5, 6, 7, 8)
    nodes = (
        NodePlacement("a", "10.0.0.1", "head", ports, "/w/n0", 10, 10, restarts=2),
        NodePlacement("b", "10.0.0.2", "worker", ports, "/w/n1", 11, 11, restarts=1),
        NodePlacement("c", "10.0.0.3", "worker", ports, "/w/n2", 12, 12, restarts=3),
    )
    world.store.update_cluster(active, nodes=nodes)
    samples = await world.scrape()
    assert value(samples, "servekeeper_node_restarts_total", service=NAME, cluster=active, role="head") == 2
    assert value(samples, "servekeeper_node_restarts_total", service=NAME, cluster=active, role="worker") == 4


async def test_each_worker_groups_nodes_are_shown_against_its_bounds(world: World) -> None:
    groups = [{"name": "cpu", "replicas": 1, "minReplicas": 0, "maxReplicas": 3}]
    config = {"head": {"numCpus": 1}, "enableInTreeAutoscaling": True, "workerGroups": groups}
    await world.roll_out(make_spec(rayClusterConfig=config))
    active = world.active()
    ports = NodePorts(1, 2, 3, 4, 5, 6, 7, 8)
    nodes = (
        NodePlacement("localhost", "127.0.0.1", "head", ports, "/w", 10, 10, node_id=0),
        NodePlacement("localhost", "127.0.0.1", "worker", ports, "/w", 11, 11, group="cpu", node_id=1),
        NodePlacement("localhost", "127.0.0.1", "worker", ports, "/w", group="cpu", node_id=2),  # asked for
    )
    world.store.update_cluster(active, nodes=nodes)
    samples = await world.scrape()
    figures = {"running": 1, "desired": 2, "min": 0, "max": 3}
    for state, count in figures.items():
        labels = {"service": NAME, "cluster": active, "group": "cpu", "state": state}
        assert value(samples, "servekeeper_worker_group_nodes", **labels) == count, state


async def test_a_standby_shows_ready_and_its_promotion_counts_as_a_failover(world: World) -> None:
    await world.roll_out(make_spec(standby={"mode": "hot"}))
    for _ in range(4):
        await world.tick()
        world.serve.set_status("RUNNING")
    assert value(await world.scrape(), "servekeeper_standby_ready", service=NAME) == 1
    active = world.active()
    provider = world.controller.executor.provider
    assert isinstance(provider, FakeProvider)
    provider.set_alive(active, False)
    await world.tick()
    samples = await world.scrape()
    assert world.active() != active
    assert value(samples, "servekeeper_standby_failovers_total", service=NAME) == 1
    assert value(samples, "servekeeper_standby_ready", service=NAME) == 0, "the next standby is not ready yet"


async def test_a_standby_taken_by_a_rollout_is_counted(world: World) -> None:
    spec = {"standby": {"mode": "warm"}, "serveConfigUpdate": "NewCluster"}
    await world.roll_out(make_spec(**spec))
    for _ in range(4):
        await world.tick()
        world.serve.set_status("RUNNING")
    assert value(await world.scrape(), "servekeeper_standby_ready", service=NAME) == 1
    app = {"name": "hello", "route_prefix": "/", "import_path": "hello:app", "args": {"msg": "v2"}}
    world.apply(make_spec(serveConfig={"applications": [app]}, **spec))  # a Serve-config change
    await world.tick()
    samples = await world.scrape()
    assert value(samples, "servekeeper_standbys_taken_total", service=NAME) == 1
    assert value(samples, "servekeeper_standby_ready", service=NAME) == 0, "taken: no standby until the rollout ends"


async def test_failed_and_aborted_rollouts_are_counted(world: World) -> None:
    await world.roll_out(make_spec())
    world.apply(make_spec(cpus=2))
    await world.tick()  # pending cluster for generation 2
    world.apply(make_spec(cpus=3))  # a newer spec while it comes up: that rollout is aborted
    await world.tick()
    samples = await world.scrape()
    assert value(samples, "servekeeper_rollouts_total", service=NAME, result="aborted") == 1
    await world.tick()
    await world.tick()
    await world.tick()
    pending = next(c for c in world.store.list_clusters(NAME) if c.role == ClusterRole.PENDING)
    world.serve.set_status("DEPLOY_FAILED", "boom", dashboard_url=pending.dashboard_url)
    await world.tick()
    samples = await world.scrape()
    assert value(samples, "servekeeper_rollouts_total", service=NAME, result="failed") == 1
    assert value(samples, "servekeeper_rollouts_total", service=NAME, result="succeeded") == 1
    assert value(samples, "servekeeper_service_condition", service=NAME, type="RolloutFailed") == 1
    assert value(samples, "servekeeper_rollout_duration_seconds_count", service=NAME) == 1


async def test_tick_durations_and_config_puts_count_per_service() -> None:
    counters = ControllerMetrics()
    counters.tick_finished("a", 0.02)
    counters.tick_finished("a", 3.0)
    counters.config_submitted("b")
    samples = parse(b"".join(_render(counters)).decode())
    assert value(samples, "servekeeper_reconcile_duration_seconds_count", service="a") == 2
    assert value(samples, "servekeeper_reconcile_duration_seconds_bucket", service="a", le="0.025") == 1
    assert value(samples, "servekeeper_config_submissions_total", service="b") == 1
    assert ControllerMetrics() is not counters  # no global registry: as many as wanted, no clash


def _render(counters: ControllerMetrics) -> list[bytes]:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(counters)
    return [generate_latest(registry)]


def test_the_apply_time_is_kept_per_generation(tmp_path: Path) -> None:
    store = Store(tmp_path / "store.db")
    record_applied(store, NAME, 3, 100.0)
    assert applied_at(store, NAME, 3) == 100.0
    assert applied_at(store, NAME, 2) is None  # another generation's time is never used
    store.close()


def test_metrics_need_the_token_on_the_api_and_not_on_the_metrics_app(tmp_path: Path) -> None:
    store = Store(tmp_path / "store.db")

    async def shutdown(stop_clusters: bool) -> None:
        return None

    class Snapshots:
        def wake(self, name: str) -> None:
            return None

        def status_snapshot(self, name: str) -> None:
            return None

    metrics = Metrics(store, ControllerMetrics(), lambda name: None)
    app = build_app(Snapshots(), store, "tok", shutdown)  # type: ignore[arg-type]
    add_metrics_route(app, metrics)
    with TestClient(app) as api:
        assert api.get("/metrics").status_code == 401
        assert api.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        answer = api.get("/metrics", headers={"Authorization": "Bearer tok"})
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
        assert "/metrics" not in api.get("/openapi.json").json()["paths"]
    with TestClient(build_metrics_app(metrics)) as open_metrics:
        answer = open_metrics.get("/metrics")
        assert answer.status_code == 200 and "servekeeper_dataplane_stats_up" in answer.text
    store.close()


def test_json_log_lines_carry_the_event_fields() -> None:
    record = logging.LogRecord("servekeeper.controller", logging.WARNING, __file__, 1, "[%s] %s", ("svc", "x"), None)
    record.__dict__.update({"service": "svc", "event_type": "Warning", "reason": "RolloutFailed", "event_time": 5.0})
    line = json.loads(JsonLogFormatter().format(record))
    assert line["message"] == "[svc] x" and line["level"] == "WARNING"
    fields = (line["service"], line["reason"], line["event_type"], line["event_time"])
    assert fields == ("svc", "RolloutFailed", "Warning", 5.0)


def test_asyncssh_logs_only_its_warnings() -> None:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging()
        assert not logging.getLogger("asyncssh").isEnabledFor(logging.INFO)
        assert logging.getLogger("asyncssh").isEnabledFor(logging.WARNING)
        assert logging.getLogger("servekeeper.controller").isEnabledFor(logging.INFO)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.getLogger("asyncssh").setLevel(logging.NOTSET)
