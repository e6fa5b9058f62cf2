"""Observe: what one tick sees of a service's clusters (through the provider and Ray's Serve
API) and of its ingress route (through the data plane), as one `Observation` for the planner.
Reads only; nothing here changes the world (what was sent is kept in documents.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from servekeeper.controller.documents import Packages, SubmittedDocuments
from servekeeper.controller.probes import ProbeRunner
from servekeeper.core.serve_config import build_serve_config, config_deployed, desired_config_hash
from servekeeper.dataplane import BackendStats, DataPlaneError, RouteObservation, ServiceRoute
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.enums import ClusterRole
from servekeeper.model.observation import BackendCounters, ClusterObservation, IngressRouteObservation, Observation
from servekeeper.model.records import ClusterRecord, NodePlacement, ServiceRecord
from servekeeper.model.spec import ServiceSpec
from servekeeper.providers.base import ClusterProvider, headers_kwargs
from servekeeper.rayapi.serve_api import PermanentServeError, RetryableServeError, ServeClient

logger = logging.getLogger(__name__)


class DataPlanePort(Protocol):
    """What the controller needs of the data plane (`servekeeper.dataplane.DataPlane`)."""

    async def routes(self) -> dict[str, RouteObservation]: ...

    async def set_route(self, route: ServiceRoute) -> None: ...

    async def remove_route(self, service: str) -> None: ...

    def desired_route(self, service: str) -> ServiceRoute | None: ...

    async def backend_stats(self) -> dict[str, BackendStats]: ...


def missing_workers(cluster: ClusterRecord) -> list[NodePlacement]:
    """A serving cluster's workers that should run and do not: one being started again (or whose
    start failed) is missing, unhealthy until it runs, so that a worker that keeps dying cannot
    look healthy between tries. Under Ray's autoscaler a node that never ran is capacity on its
    way (Ray asked for it, and releases it if its start is given up), not a missing node: the
    service would flap to not Ready at every scale-up."""
    down = [node for node in cluster.nodes[1:] if node.pid is None and not node.stopped]
    if not down or all(node.restarts > 0 for node in down):
        return down  # the spec is read only when it can matter: this runs at every look
    autoscaled = RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json).enableInTreeAutoscaling
    return [node for node in down if node.restarts > 0 or not autoscaled]


def nodes_starting(cluster: ClusterRecord) -> int:
    """Workers not running yet that hold back a cluster's readiness: a new cluster waits for its
    nodes. A serving one is only short of those `missing_workers` finds (an unhealthy cluster,
    told before this): a node Ray's autoscaler is adding never makes it unready."""
    if cluster.role == ClusterRole.ACTIVE:
        return 0
    return sum(1 for node in cluster.nodes[1:] if node.pid is None and not node.stopped)


class Observer:
    def __init__(
        self,
        provider: ClusterProvider,
        dataplane: DataPlanePort,
        serve: ServeClient,
        probes: ProbeRunner,
        documents: SubmittedDocuments,
        packages: Packages,
        shortfalls: dict[str, str],
        unacknowledged_routes: set[str],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.provider = provider
        self.dataplane = dataplane
        self.serve = serve
        self.probes = probes
        self.documents = documents
        self.packages = packages
        self.shortfalls = shortfalls  # service -> why its next cluster cannot be placed now
        self.unacknowledged_routes = unacknowledged_routes  # services whose last route push failed
        self.clock = clock
        # service -> (cluster, "head" or "workers") -> since when that host (a worker's: any) has
        # not answered, on every look since (in memory: after a restart the wait starts again,
        # which only makes it longer)
        self.silent_hosts: dict[str, dict[tuple[str, str], float]] = {}

    async def observe(self, service: ServiceRecord, clusters: list[ClusterRecord], spec: ServiceSpec) -> Observation:
        live = [c for c in clusters if c.role != ClusterRole.DELETING]
        looks = await asyncio.gather(*(self._observe_cluster(c, service, spec) for c in live))
        observed = self._with_silence(service.name, looks)
        route: IngressRouteObservation | None = None
        ingress_ok = True
        counters: dict[str, BackendCounters] | None = None
        try:
            observed_route = (await self.dataplane.routes()).get(service.name)
            route = observed_route.to_ingress() if observed_route is not None else None
            if route is not None:
                desired = self.dataplane.desired_route(service.name)
                route = replace(route, preview=desired.preview_backend if desired is not None else None)
            if route is not None and (
                not observed_route.in_sync  # type: ignore[union-attr]
                or service.name in self.unacknowledged_routes
                or _listener_settings_changed(self.dataplane.desired_route(service.name), spec)
            ):
                # Envoy processes disagree, the last push was not acknowledged, or the spec moved
                # or re-limited the listener or its upstream connections: the route is set again
                # (to every process).
                route = None
        except DataPlaneError as exc:
            ingress_ok = False  # every backend counts as busy: nothing is deleted on this look
            logger.warning("[%s] data plane not readable: %s", service.name, exc)
        if any(c.role == ClusterRole.PENDING and c.canary is not None for c in live):
            try:
                counters = backend_counters_of(await self.dataplane.backend_stats())
            except DataPlaneError as exc:  # no analysis verdict on this look; nothing else changes
                logger.info("[%s] ingress counters not readable: %s", service.name, exc)
        return Observation(
            clusters={o.name: o for o in observed},
            route=route,
            ingress_ok=ingress_ok,
            backend_counters=counters,
            placement_problem=self.shortfalls.get(service.name),
        )

    def forget_service(self, service: str) -> None:
        """Drop what is kept of a service that is gone (its last look may have found a host
        silent, and no look comes after it to clear that)."""
        self.silent_hosts.pop(service, None)

    def _with_silence(self, service: str, observed: list[ClusterObservation]) -> list[ClusterObservation]:
        """Each look at a silent host carries since when it has been silent, so that the planner
        waits a threshold before it counts its node as lost. Rebuilt from this look's clusters
        only: a cluster gone (or being deleted) leaves no entry."""
        before = self.silent_hosts.pop(service, {})
        now = self.clock()
        since: dict[tuple[str, str], float] = {}

        def began(look: ClusterObservation, which: str, marked: float | None) -> float | None:
            if marked is None:
                return None
            since[(look.name, which)] = before.get((look.name, which), now)
            return since[(look.name, which)]

        looks = [
            replace(
                look,
                head_silent_since=began(look, "head", look.head_silent_since),
                workers_silent_since=began(look, "workers", look.workers_silent_since),
            )
            for look in observed
        ]
        if since:
            self.silent_hosts[service] = since
        return looks

    async def _observe_cluster(
        self, cluster: ClusterRecord, service: ServiceRecord, spec: ServiceSpec
    ) -> ClusterObservation:
        liveness = await self.provider.liveness(cluster)
        # exited: of the dead workers, those known gone (restartable in place)
        alive, dead_workers, reason, exited = liveness[:4]
        if not alive:
            # A silent host is marked here; `_with_silence` puts the time its silence began.
            silent_since = self.clock() if liveness.head_silent else None
            return ClusterObservation(
                name=cluster.name, processes_alive=False, head_silent_since=silent_since, error=reason
            )
        if cluster.role == ClusterRole.ACTIVE and not dead_workers:
            missing = missing_workers(cluster)
            if missing:
                return ClusterObservation(
                    name=cluster.name,
                    processes_alive=True,
                    dead_workers=len(missing),
                    error=f"worker node on host {missing[0].host} is not running (being started again)",
                )
        if dead_workers:
            return ClusterObservation(
                name=cluster.name,
                processes_alive=True,
                dead_workers=len(dead_workers),
                exited_workers=exited,
                exit_causes=dict(liveness.exit_causes),
                silent_workers=len(liveness.silent_workers),
                workers_silent_since=self.clock() if liveness.silent_workers else None,
                error=reason,
            )
        auth = headers_kwargs(self.provider, cluster)  # only now: a cluster that never started may have no token
        capacity = None
        try:
            if cluster.target_capacity is not None:  # managed: what Ray scales to is part of the look
                apps, capacity = await self.serve.applications_with_capacity(cluster.dashboard_url, **auth)
            else:
                apps = await self.serve.applications(cluster.dashboard_url, **auth)
        except (RetryableServeError, PermanentServeError) as exc:
            return ClusterObservation(name=cluster.name, processes_alive=True, error=str(exc))
        healthy, routes = await asyncio.gather(
            self.serve.proxy_healthy(cluster.serve_url), self.serve.proxy_routes(cluster.serve_url)
        )
        return ClusterObservation(
            probes=self.probes.states(cluster.name, cluster.serve_url, spec.spec.readiness.probes),
            name=cluster.name,
            processes_alive=True,
            dashboard_ok=True,
            apps=apps,
            proxy_healthy=healthy,
            routes=routes,
            deployed_config_hash=self._deployed_config_hash(cluster, service, spec, apps),
            target_capacity=capacity,
            nodes_starting=nodes_starting(cluster),
        )

    def _deployed_config_hash(
        self, cluster: ClusterRecord, service: ServiceRecord, spec: ServiceSpec, apps: dict[str, Any]
    ) -> str | None:
        """Which config servekeeper sent does Ray run now? Compared app by app with Ray's
        deployed_app_config: the desired one first, then the ones this cluster was given before."""
        desired = desired_config_hash(spec, service.package_hash)
        candidates = {desired: build_serve_config(spec, cluster, self.packages.uri(service))}
        for known in (cluster.applied_config_hash, cluster.good_config_hash, cluster.submitted_config_hash):
            if known is not None and known not in candidates:
                document = self.documents.get(cluster.name, known)
                if document is not None:
                    candidates[known] = document
        for config_hash, document in candidates.items():
            if config_deployed(document, apps):
                return config_hash
        return None


def _listener_settings_changed(route: ServiceRoute | None, spec: ServiceSpec) -> bool:
    if route is None:
        return False
    ingress = spec.spec.ingress
    observed = (
        route.port,
        route.grpc_port,
        route.max_request_bytes,
        route.request_timeout_s,
        route.idle_timeout_s,
        route.silent_upstream_s,
        route.preview_port,
    )
    return observed != (
        ingress.port,
        ingress.grpcPort,
        ingress.maxRequestBytes,
        ingress.requestTimeoutSeconds,
        ingress.idleTimeoutSeconds,
        ingress.silentUpstreamSeconds,
        ingress.previewPort,
    )


def backend_counters_of(stats: dict[str, BackendStats]) -> dict[str, BackendCounters]:
    """What a canary's analysis reads of each backend's ingress stats."""
    return {
        name: BackendCounters(
            requests=backend.rq_completed,
            # A request the backend refused is its failure, though the standby answered it (an
            # upper bound: a standby's own 5xx to such a request is in both figures).
            errors_5xx=backend.rq_5xx + backend.rq_failed_over,
            latency_ms_buckets=tuple(sorted(backend.latency_ms_buckets.items())),
            epoch=backend.epoch,
        )
        for name, backend in stats.items()
    }
