"""Prometheus metrics of the daemon (`GET /metrics`), produced with prometheus_client.

Two kinds, kept apart:
- what happened (counters and histograms): the controller reports rollouts that ended, config
  PUTs and tick durations to the `ControllerMetrics` it was given at construction;
- what is (gauges, and Envoy's own counters): read at scrape time by `StateCollector` from the
  store, the controller's latest observations and the data plane's per-cluster stats.

No global registry: each daemon (and each test) builds its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from servekeeper.controller.metric_families import StateFamilies, seconds_buckets
from servekeeper.dataplane.model import BackendStats, DataPlaneError, RouteObservation
from servekeeper.model.enums import ClusterRole, ConditionType
from servekeeper.model.observation import IngressRouteObservation, Observation
from servekeeper.model.records import Event, ServiceRecord
from servekeeper.model.spec import ServiceSpec
from servekeeper.store.facts import applied_at_fact_key
from servekeeper.store.store import Store
from servekeeper.views.service import cluster_config, worker_group_views

logger = logging.getLogger(__name__)
T = TypeVar("T")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ROLLOUT_RESULTS = ("succeeded", "failed", "aborted")
# A rollout takes from seconds (in place) to minutes (a new cluster, probes, big images).
ROLLOUT_BUCKETS = (5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600, 1200, 1800, math.inf)
RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, math.inf)
STATS_TIMEOUT_S = 2.0


def applied_at_fact(service: str) -> str:
    """The store fact that holds when the service's latest generation was applied (the API writes
    it in the same transaction as the spec): {"generation": g, "time": t}."""
    return applied_at_fact_key(service)


def record_applied(store: Store, service: str, generation: int, now: float) -> None:
    store.set_fact(applied_at_fact(service), {"generation": generation, "time": now})


def applied_at(store: Store, service: str, generation: int) -> float | None:
    fact = store.get_fact(applied_at_fact(service))
    if isinstance(fact, dict) and fact.get("generation") == generation:
        return float(fact["time"])
    return None


class ControllerMetrics(Collector):
    """What the controller counts as it happens. A collector over a registry of its own.

    Rollout results, per generation of a service:
    - succeeded: observedGeneration reached the generation with Ready and without RolloutFailed
      (a new cluster switched to, or a config change applied in place); its duration, from the
      apply of that generation to that moment, goes to servekeeper_rollout_duration_seconds;
    - failed: each RolloutFailed event (a pending cluster or an in-place change failed);
    - aborted: each PendingClusterReplaced event (a newer spec came while a cluster came up or
      ran as a canary) and each RolloutAborted (canary analysis failed, or `servekeeper abort`).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.rollouts = Counter(
            "servekeeper_rollouts",
            "Rollouts that ended, by result (succeeded, failed, aborted).",
            ["service", "result"],
            registry=self.registry,
        )
        self.rollout_duration = Histogram(
            "servekeeper_rollout_duration_seconds",
            "From the apply of a generation to its rollout (all traffic on it, Ready).",
            ["service"],
            buckets=ROLLOUT_BUCKETS,
            registry=self.registry,
        )
        self.config_submissions = Counter(
            "servekeeper_config_submissions",
            "Serve config PUTs sent to a cluster's dashboard (each attempt).",
            ["service"],
            registry=self.registry,
        )
        self.failovers = Counter(
            "servekeeper_standby_failovers",
            "Hot standbys promoted to active (the active's head exited, or it stayed unhealthy).",
            ["service"],
            registry=self.registry,
        )
        self.standbys_taken = Counter(
            "servekeeper_standbys_taken",
            "Standbys a rollout took as its new cluster (a Serve config rolled on a new cluster of the same spec).",
            ["service"],
            registry=self.registry,
        )
        self.reconcile_duration = Histogram(
            "servekeeper_reconcile_duration_seconds",
            "Duration of one reconcile tick (observe, plan, execute, persist).",
            ["service"],
            buckets=RECONCILE_BUCKETS,
            registry=self.registry,
        )

    def collect(self) -> Iterable[Metric]:
        return self.registry.collect()

    def forget_service(self, service: str) -> None:
        """Drop a deleted service's series: a daemon that runs many short-lived services keeps
        no label set per name it ever saw (a service applied again starts its counters at 0)."""
        labelled: list[tuple[Counter | Histogram, tuple[str, ...]]] = [
            (self.rollouts, (service, result)) for result in ROLLOUT_RESULTS
        ]
        labelled += [
            (m, (service,))
            for m in (
                self.rollout_duration,
                self.config_submissions,
                self.reconcile_duration,
                self.failovers,
                self.standbys_taken,
            )
        ]
        for metric, labels in labelled:
            with contextlib.suppress(KeyError):  # a series never created
                metric.remove(*labels)

    def tick_finished(self, service: str, seconds: float) -> None:
        self.reconcile_duration.labels(service).observe(seconds)

    def config_submitted(self, service: str) -> None:
        self.config_submissions.labels(service).inc()

    def tick_persisted(
        self, store: Store, before: ServiceRecord, after: ServiceRecord, events: list[Event], now: float
    ) -> None:
        """After a tick stored its status and events: count the rollouts that ended in it."""
        name = before.name
        for result in ROLLOUT_RESULTS:
            self.rollouts.labels(name, result)  # every series exists from the first tick on, at 0
        for event in events:
            if event.reason == "RolloutFailed":
                self.rollouts.labels(name, "failed").inc()
            elif event.reason in ("PendingClusterReplaced", "RolloutAborted"):
                self.rollouts.labels(name, "aborted").inc()
            elif event.reason == "StandbyPromoted":
                self.failovers.labels(name).inc()
            elif event.reason == "StandbyTaken":
                self.standbys_taken.labels(name).inc()
        if after.observed_generation == before.observed_generation:
            return
        # What the store holds now: the status was written only if no new spec or delete came.
        stored = store.get_service(name)
        if stored is None or stored.observed_generation != after.observed_generation:
            return
        if not _rolled_out(stored):
            return
        self.rollouts.labels(name, "succeeded").inc()
        applied = applied_at(store, name, stored.generation)
        if applied is not None and now >= applied:
            self.rollout_duration.labels(name).observe(now - applied)


def _wants_standby(service: ServiceRecord) -> bool:
    try:
        return ServiceSpec.model_validate_json(service.spec_json).spec.standby is not None
    except ValueError:  # a spec stored by an older version: no standby asked for
        return False


def _rolled_out(service: ServiceRecord) -> bool:
    if service.observed_generation != service.generation or service.failed_generation == service.generation:
        return False
    outdated = service.condition(ConditionType.CLUSTER_SPEC_OUTDATED)
    ready = service.condition(ConditionType.READY)
    return (outdated is None or not outdated.status) and ready is not None and ready.status


class StateCollector(Collector):
    """Gauges of the current state, and Envoy's per-cluster counters, read when scraped."""

    def __init__(
        self,
        store: Store,
        observation: Callable[[str], Observation | None],
        routes: Mapping[str, RouteObservation] | None,
        backend_stats: Mapping[str, BackendStats] | None,
    ) -> None:
        self.store = store
        self.observation = observation
        self.routes = routes
        self.backend_stats = backend_stats

    def collect(self) -> Iterator[Metric]:
        families = StateFamilies.create()
        families.dataplane_up.add_metric([], 0 if self.backend_stats is None or self.routes is None else 1)
        for service in self.store.list_services():
            name = service.name
            for condition_type in ConditionType:
                found = service.condition(condition_type)
                if found is not None:
                    families.condition.add_metric([name, condition_type.value], 1 if found.status else 0)
            families.generation.add_metric([name], service.generation)
            families.observed.add_metric([name], service.observed_generation)
            if _wants_standby(service):
                standbys = [c for c in self.store.list_clusters(name) if c.role == ClusterRole.STANDBY]
                families.standby_ready.add_metric([name], 1 if any(c.ready_at is not None for c in standbys) else 0)
            self._add_clusters(families, name)
        yield from families.all()

    def _add_clusters(self, families: StateFamilies, name: str) -> None:
        """Each cluster's traffic share, and its ingress counters: read now, or when they cannot
        be read, the controller's last look at the ingress."""
        snapshot = self.observation(name)
        routed = snapshot.route if snapshot is not None else None
        stats = self.backend_stats or {}
        weights = self._traffic_shares(name, routed)
        for cluster in self.store.list_clusters(name):
            families.traffic.add_metric([name, cluster.name, cluster.role.value], weights.get(cluster.name, 0.0))
            for group in worker_group_views(cluster, cluster_config(cluster)):  # from the record
                for state, count in (("running", group["nodes"]), ("desired", group["desired"])):
                    families.group_nodes.add_metric([name, cluster.name, group["name"], state], count)
                for state, count in (("min", group["minNodes"]), ("max", group["maxNodes"])):
                    families.group_nodes.add_metric([name, cluster.name, group["name"], state], count)
            for role in sorted({node.role for node in cluster.nodes}):  # from the record: kept across restarts
                count = sum(node.restarts for node in cluster.nodes if node.role == role)
                families.restarts.add_metric([name, cluster.name, role], count)
            backend = stats.get(cluster.name)
            if backend is not None:
                families.inflight.add_metric([name, cluster.name], backend.rq_active)
                classes = {"2xx": backend.rq_2xx, "4xx": backend.rq_4xx, "5xx": backend.rq_5xx}
                for code_class, count in classes.items():
                    families.requests.add_metric([name, cluster.name, code_class], count)
                buckets = seconds_buckets(backend.latency_ms_buckets)
                if buckets:
                    families.latency.add_metric([name, cluster.name], buckets, sum_value=None)
            elif routed is not None and cluster.name in routed.inflight:
                # No fresh stats this scrape: the controller's last look at the ingress.
                families.inflight.add_metric([name, cluster.name], routed.inflight[cluster.name])

    def _traffic_shares(self, name: str, routed: IngressRouteObservation | None) -> dict[str, float]:
        """Cluster -> share of the service's traffic (0 to 1), as every Envoy acknowledged it."""
        if self.routes is not None:
            route = self.routes.get(name)
            total = sum(route.weights.values()) if route is not None else 0
            return {b: w / total for b, w in route.weights.items()} if route is not None and total else {}
        if routed is not None and routed.active is not None:
            return {routed.active: 1.0}
        return {}


class Metrics:
    """What `GET /metrics` answers: the controller's counters plus the state read now."""

    def __init__(
        self,
        store: Store,
        controller_metrics: ControllerMetrics,
        observation: Callable[[str], Observation | None],
        routes: Callable[[], Awaitable[Mapping[str, RouteObservation]]] | None = None,
        backend_stats: Callable[[], Awaitable[Mapping[str, BackendStats]]] | None = None,
    ) -> None:
        self.store = store
        self.controller_metrics = controller_metrics
        self.observation = observation
        self._routes = routes
        self._backend_stats = backend_stats

    async def render(self) -> bytes:
        routes, stats = await asyncio.gather(_read(self._routes), _read(self._backend_stats))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.controller_metrics)
        registry.register(StateCollector(self.store, self.observation, routes, stats))
        return generate_latest(registry)


async def _read(source: Callable[[], Awaitable[Mapping[str, T]]] | None) -> Mapping[str, T] | None:
    """One read of the data plane for a scrape; None when it cannot be read (or is not given)."""
    if source is None:
        return None
    try:
        return await asyncio.wait_for(source(), STATS_TIMEOUT_S)
    except (DataPlaneError, asyncio.TimeoutError) as exc:
        logger.info("metrics: data plane not read: %s", exc)
        return None
